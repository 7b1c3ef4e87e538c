"""The one composer: TP -> EP -> CP -> PP split -> AC -> compile -> FSDP, each guarded and logged.

No Lightning here: ``parallelize(module, dims, mesh, config)`` works on any ``nn.Module``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from lightning_nd.layout.options import ParallelConfig, check_config, check_model
from lightning_nd.layout.dims import ParallelDims
from lightning_nd.runtime.mesh import NDMesh
from lightning_nd.parallel.activation import apply_ac, apply_compile
from lightning_nd.parallel.context.region import accepts_positions, inject_positions
from lightning_nd.parallel.fsdp import apply_fsdp, fsdp_root
from lightning_nd.parallel.expert import apply_ep, expert_modules, expert_parameters
from lightning_nd.parallel.tensor import apply_tp
from lightning_nd.parallel.pipeline.stage import PipelineStages, StageModule
from lightning_nd.layout.tp_plan import TPPlan
from lightning_nd.parallel.pipeline.build import StagePlan, build_stages, plan_stages, stage_blocks, stage_tp_entries

log = logging.getLogger("lightning_nd")


@dataclass
class ParallelizeReport:
    """What the composer did, for logs and tests."""

    blocks: list[str] = field(default_factory=list)
    tp_plan: TPPlan | None = None
    applied: list[str] = field(default_factory=list)
    stage_plan: StagePlan | None = None
    stages: list[StageModule] = field(default_factory=list)
    module: nn.Module | None = None


def parallelize(
    module: nn.Module,
    dims: ParallelDims,
    mesh: NDMesh,
    config: ParallelConfig,
    *,
    forward_methods: Sequence[str] = (),
) -> ParallelizeReport:
    """Apply every enabled technique to ``module`` in the fixed order, in place.

    Under pp the model is split first (each stage is then parallelized on its own, as a model of
    its own) and the LightningModule's model attribute becomes this rank's `PipelineStages`.
    """
    check_config(dims.as_dict(), config)
    blocks, plan = check_model(module, dims, config)
    report = ParallelizeReport(blocks=[name for name, _ in blocks], tp_plan=plan, module=module)
    if not dims.pp_enabled:
        if dims.ep > 1:
            _apply_ep(module, mesh, dims, report)
        if dims.cp > 1:
            _apply_cp(fsdp_root(module), dims, report)
        _apply(module, blocks, plan.entries if plan else None, dims, mesh, config, report, forward_methods=forward_methods)
        return report
    _disable_kv_cache(module)
    report.stage_plan = stage_plan = plan_stages(module, blocks, dims, config)
    stages = build_stages(module, stage_plan, mesh.local_rank("pp"))
    layout = stage_plan.layout
    _applied(report, f"Split the model into {stage_plan.num_stages} pipeline stages from {layout.source}:"
                     f" {layout.describe()}; schedule {config.pp_schedule} with {config.pp_microbatches} microbatches")
    for index, stage in enumerate(stages):
        if dims.ep > 1:
            _apply_ep(stage, mesh, dims, report, quiet=index > 0)
        if dims.cp > 1:
            _apply_cp(stage.module, dims, report, quiet=index > 0)
        entries = stage_tp_entries(plan.entries, stage_plan.attribute, stage) if plan else None
        _apply(stage, stage_blocks(stage), entries, dims, mesh, config, report, root_unit=stage, quiet=index > 0)
        stage.attach()
    setattr(module, stage_plan.attribute, PipelineStages(stages))
    report.stages = stages
    return report


def _apply(
    module: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    tp_entries: dict[str, object] | None,
    dims: ParallelDims,
    mesh: NDMesh,
    config: ParallelConfig,
    report: ParallelizeReport,
    *,
    forward_methods: Sequence[str] = (),
    root_unit: nn.Module | None = None,
    quiet: bool = False,
) -> None:
    """TP -> AC -> compile -> FSDP on one model (or one pipeline stage)."""
    names, block_modules = [name for name, _ in blocks], [block for _, block in blocks]
    applied = (lambda message: None) if quiet else (lambda message: _applied(report, message))  # noqa: E731
    if tp_entries is not None:
        apply_tp(module, mesh["tp"], tp_entries, sequence_parallel=config.sequence_parallel,
                 loss_parallel=config.loss_parallel, block_names=names)
        applied(f"Applied tensor parallel (tp={dims.tp}, sequence_parallel={config.sequence_parallel},"
                f" loss_parallel={config.loss_parallel}) to {len(tp_entries)} modules from {report.tp_plan.source}")
    if config.activation_checkpointing != "none":
        _disable_kv_cache(module)
        apply_ac(block_modules, config.activation_checkpointing)
        applied(f"Applied {config.activation_checkpointing} activation checkpointing to {len(blocks)} blocks")
    if config.compile:
        backend = config.compile if isinstance(config.compile, str) else "inductor"
        apply_compile(block_modules, backend)
        applied(f"Compiled {len(blocks)} blocks with torch.compile(backend={backend!r})")
    if dims.dp_enabled or dims.fsdp_enabled:
        hsdp = dims.dp_replicate > 1
        apply_fsdp(
            module, block_modules, mesh["hsdp"] if hsdp else mesh["fsdp"],
            zero_stage=config.zero_stage, param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype,
            cpu_offload=config.cpu_offload, forward_methods=forward_methods, root_unit=root_unit,
            **_expert_sharding(module, mesh, dims),
        )
        kind = f"HSDP (replicate={dims.dp_replicate} x shard={dims.dp_shard * dims.cp})" if hsdp else (
            f"FSDP (shard={dims.dp_shard * dims.cp})")
        where = "each stage's blocks and the stage" if root_unit is not None else f"{len(blocks)} blocks and the root"
        applied(f"Applied {kind} with zero_stage={config.zero_stage} to {where}")


def _expert_sharding(module: nn.Module, mesh: NDMesh, dims: ParallelDims) -> dict:
    """Under ep, how FSDP treats the experts: sharded over the ranks holding the same experts when there are
    several, else left alone (one rank per expert: nothing to average)."""
    experts = expert_modules(module)
    if not experts:
        return {}
    if mesh.size("expert_dp") > 1:
        return {"experts": experts, "expert_mesh": mesh["expert_dp"]}
    return {"ignored_params": set(expert_parameters(module))}


def _apply_ep(module: nn.Module, mesh: NDMesh, dims: ParallelDims, report: ParallelizeReport,
              quiet: bool = False) -> None:
    """Expert parallel: experts modules become this rank's slice, their gradient sums scaled to means."""
    names = apply_ep(module, mesh["ep"])  # check_model made sure there are some
    for experts in expert_modules(module):
        experts.grad_scale = 1.0 / dims.ep  # the ep group's tokens add up; dense gradients are means
    if not quiet and names:
        _applied(report, f"Applied expert parallel (ep={dims.ep}) to {len(names)} experts modules: each rank holds"
                         f" 1/{dims.ep} of the experts, tokens dispatched by all-to-all")


def _apply_cp(model: nn.Module, dims: ParallelDims, report: ParallelizeReport, quiet: bool = False) -> None:
    """Context parallel: the model is given global positions inside the cp region (attention is routed there)."""
    model.register_forward_pre_hook(inject_positions, with_kwargs=True)
    if quiet:
        return
    if accepts_positions(model):
        _applied(report, f"Applied context parallel (cp={dims.cp}, ring attention, zigzag sequence sharding):"
                         f" `{type(model).__name__}` gets global `position_ids`")
    else:
        _applied(report, f"Applied context parallel (cp={dims.cp}, ring attention, zigzag sequence sharding)")
        log.warning("`%s.forward` takes no `position_ids`: under cp it sees only its shard of each sequence, so"
                    " positions it computes itself (rotary, learned) would be wrong. Give it a `position_ids`"
                    " argument (0..seq-1 when None), as Hugging Face models have.", type(model).__name__)


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
