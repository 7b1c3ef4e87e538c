"""The one composer: TP -> EP -> CP -> PP split -> AC -> compile -> FSDP, each guarded and logged.

No Lightning here: ``parallelize(module, dims, mesh, config)`` works on any ``nn.Module``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from lightning_nd.config import ParallelConfig, check_config, check_model
from lightning_nd.dims import ParallelDims
from lightning_nd.mesh import NDMesh
from lightning_nd.parallel.activation import apply_ac, apply_compile
from lightning_nd.parallel.data import apply_fsdp
from lightning_nd.parallel.tensor import apply_tp
from lightning_nd.plans import TPPlan

log = logging.getLogger("lightning_nd")


@dataclass
class ParallelizeReport:
    """What the composer did, for logs and tests."""

    blocks: list[str] = field(default_factory=list)
    tp_plan: TPPlan | None = None
    applied: list[str] = field(default_factory=list)


def parallelize(
    module: nn.Module,
    dims: ParallelDims,
    mesh: NDMesh,
    config: ParallelConfig,
    *,
    forward_methods: Sequence[str] = (),
) -> ParallelizeReport:
    """Apply every enabled technique to ``module`` in the fixed order, in place."""
    check_config(dims.as_dict(), config)
    blocks, plan = check_model(module, dims, config)
    report = ParallelizeReport(blocks=[name for name, _ in blocks], tp_plan=plan)
    block_modules = [block for _, block in blocks]

    if plan is not None:
        apply_tp(
            module, mesh["tp"], plan.entries,
            sequence_parallel=config.sequence_parallel, loss_parallel=config.loss_parallel,
            block_names=report.blocks,
        )
        _applied(report, f"Applied tensor parallel (tp={dims.tp}, sequence_parallel={config.sequence_parallel},"
                         f" loss_parallel={config.loss_parallel}) to {len(plan.entries)} modules from {plan.source}")
    if config.activation_checkpointing != "none":
        _disable_kv_cache(module)
        apply_ac(block_modules, config.activation_checkpointing)
        _applied(report, f"Applied {config.activation_checkpointing} activation checkpointing to {len(blocks)} blocks")
    if config.compile:
        backend = config.compile if isinstance(config.compile, str) else "inductor"
        apply_compile(block_modules, backend)
        _applied(report, f"Compiled {len(blocks)} blocks with torch.compile(backend={backend!r})")
    if dims.dp_enabled or dims.fsdp_enabled:
        hsdp = dims.dp_replicate > 1
        apply_fsdp(
            module, block_modules, mesh["hsdp"] if hsdp else mesh["dp_shard_cp"],
            zero_stage=config.zero_stage, param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype,
            cpu_offload=config.cpu_offload, forward_methods=forward_methods,
        )
        kind = f"HSDP (replicate={dims.dp_replicate} x shard={dims.dp_shard * dims.cp})" if hsdp else (
            f"FSDP (shard={dims.dp_shard * dims.cp})")
        _applied(report, f"Applied {kind} with zero_stage={config.zero_stage} to {len(blocks)} blocks and the root")
    return report


def _disable_kv_cache(module: nn.Module) -> None:
    """A KV cache filled during forward changes what recomputation sees (Hugging Face models keep
    ``config.use_cache=True`` even in training); their own gradient checkpointing turns it off too."""
    for name, submodule in module.named_modules():
        config = getattr(submodule, "config", None)
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False
            log.info("Set `%s.config.use_cache=False`: a KV cache breaks activation recomputation", name or "model")


def _applied(report: ParallelizeReport, message: str) -> None:
    report.applied.append(message)
    log.info(message)
