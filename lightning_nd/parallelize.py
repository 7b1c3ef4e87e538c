"""The one composer: TP -> EP -> CP -> PP split -> AC -> compile -> FSDP, each guarded and logged.

No Lightning here: ``parallelize(module, dims, mesh, config)`` works on any ``nn.Module``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from lightning_nd.dims import ParallelDims
from lightning_nd.mesh import NDMesh
from lightning_nd.parallel.activation import AC_MODES, apply_ac, apply_compile
from lightning_nd.parallel.data import ZERO_STAGES, apply_fsdp
from lightning_nd.parallel.tensor import apply_tp
from lightning_nd.plans import TPPlan, resolve_tp_plan
from lightning_nd.structure import ModelFacts, find_blocks, read_model_facts

log = logging.getLogger("lightning_nd")


@dataclass(kw_only=True)
class ParallelConfig:
    """How to parallelize, beyond the sizes of the dims."""

    zero_stage: Literal[1, 2, 3] = 3
    """What FSDP shards: 3 = params+grads+optimizer (params freed after forward), 2 = params kept from
    forward to backward, 1 = only optimizer state across a gradient-accumulation window."""
    tp_plan: Mapping[str, object] | None = None
    """Explicit TP plan: module-name pattern (``*`` = one component) -> style name or `ParallelStyle`."""
    sequence_parallel: bool = False
    """Shard the residual stream (norms, dropout) over tp along the sequence: saves activation memory."""
    loss_parallel: bool = False
    """Keep the head's logits sharded over the vocabulary; the loss is computed without gathering them."""
    block_classes: Sequence[type | str] | None = None
    """Classes (or class names) of the repeated blocks; auto-detected when None."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations per block in backward: all of them, or all but matmul/attention outputs."""
    compile: bool | str = False
    """``torch.compile`` each block; a string names the backend (True means ``"inductor"``)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 offload policy)."""
    param_dtype: torch.dtype | None = None
    """FSDP compute dtype for parameters (set from `bf16-mixed` by the strategy)."""
    reduce_dtype: torch.dtype | None = None
    """FSDP gradient-reduction dtype."""

    def __post_init__(self) -> None:
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"`zero_stage={self.zero_stage!r}` must be one of {ZERO_STAGES}."
                             " HINT: 3 for the least memory, 2 for less communication.")
        if self.activation_checkpointing not in AC_MODES:
            raise ValueError(
                f"`activation_checkpointing={self.activation_checkpointing!r}` is not a mode. HINT: use one of {AC_MODES}:"
                " 'selective' recomputes cheap ops only, 'full' recomputes whole blocks (least memory)."
            )


@dataclass
class ParallelizeReport:
    """What the composer did, for logs and tests."""

    blocks: list[str] = field(default_factory=list)
    tp_plan: TPPlan | None = None
    applied: list[str] = field(default_factory=list)


NOT_YET = {"pp": "pipeline", "cp": "context", "ep": "expert"}


def check_config(sizes: Mapping[str, int], config: ParallelConfig) -> None:
    """Options that need a dim that is off, and dims this release does not run; -1 (not yet known) passes."""
    for name, technique in NOT_YET.items():
        if sizes[name] > 1:
            raise ValueError(
                f"`NDParallel({name}={sizes[name]})`: {technique} parallelism is not available in this"
                f" release of lightning-nd. HINT: use `{name}=1` and put the ranks into dp_shard or tp."
            )
    if config.compile and sizes["tp"] > 1:
        raise ValueError(
            f"`NDParallel(compile=..., tp={sizes['tp']})`: compiled blocks with tensor parallelism gave wrong gradients"
            " in our parity test (torch 2.13, gloo), so this release refuses the combination."
            " HINT: compile with tp=1 (FSDP/HSDP layouts), or keep tp and set compile=False."
        )
    for option in ("sequence_parallel", "loss_parallel"):
        if getattr(config, option) and sizes["tp"] == 1:
            raise ValueError(
                f"`NDParallel({option}=True)` splits work over tp, but tp=1. HINT: set tp > 1 or {option}=False."
            )


def inspect_model(module: nn.Module, config: ParallelConfig) -> tuple[list[tuple[str, nn.Module]], ModelFacts]:
    blocks = find_blocks(module, config.block_classes)
    return blocks, read_model_facts(module, blocks)


def check_model(module: nn.Module, dims: ParallelDims, config: ParallelConfig) -> TPPlan | None:
    """Everything about the model that can be wrong for these dims; raises before any weight moves."""
    blocks, facts = inspect_model(module, config)
    if config.block_classes and not blocks:
        raise ValueError(
            f"`block_classes={list(config.block_classes)}` matches no module of `{type(module).__name__}`."
            f" HINT: use one of the classes it contains, e.g. {_repeated_class_names(module)}."
        )
    if dims.pp > 1 and facts.num_hidden_layers is not None and dims.pp > facts.num_hidden_layers:
        raise ValueError(
            f"`NDParallel(pp={dims.pp})` exceeds the model's {facts.num_hidden_layers} layers."
            f" HINT: choose pp <= {facts.num_hidden_layers}."
        )
    if dims.ep > 1 and facts.num_experts is not None and facts.num_experts % dims.ep:
        valid = [d for d in range(1, facts.num_experts + 1) if facts.num_experts % d == 0]
        raise ValueError(
            f"`NDParallel(ep={dims.ep})` does not divide `num_experts={facts.num_experts}`. HINT: choose ep from {valid}."
        )
    if dims.dp_enabled or dims.fsdp_enabled:
        if not blocks:
            log.warning("No repeated blocks found: FSDP shards the whole model as one unit (more peak memory)."
                        " Pass `NDParallel(block_classes=[...])` to shard block by block.")
    if not dims.tp_enabled:
        return None
    return resolve_tp_plan(
        module, config.tp_plan, tp=dims.tp, facts=facts, sequence_parallel=config.sequence_parallel
    )


def _repeated_class_names(module: nn.Module) -> list[str]:
    counts: dict[str, int] = {}
    for child in module.modules():
        counts[type(child).__name__] = counts.get(type(child).__name__, 0) + 1
    return sorted(name for name, count in counts.items() if count > 1)[:5]


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
    plan = check_model(module, dims, config)
    blocks, _ = inspect_model(module, config)
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
