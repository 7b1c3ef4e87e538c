"""The one composer: it applies a `Layout` in the Layout's order: pipeline split -> EP -> CP -> TP -> AC ->
compile -> FSDP/HSDP, each guarded by the plan and logged from its `Technique` record.

No Lightning and no planning here: ``parallelize(module, mesh, layout)`` works on any ``nn.Module`` for which
`plan_layout` made ``layout``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_nd.context_parallel.region import attach_position_hooks
from lightning_nd.expert_parallel.dispatch import apply_ep, expert_modules, expert_parameters
from lightning_nd.expert_parallel.lists import entries_held_here
from lightning_nd.layout.record import Layout, Technique
from lightning_nd.mesh.build import NDMesh
from lightning_nd.model.structure import get_submodule
from lightning_nd.parallel.activation import apply_ac, apply_compile
from lightning_nd.parallel.fsdp import apply_fsdp, fsdp_root
from lightning_nd.pipeline_parallel.build import build_stages, stage_blocks, stage_tp_entries
from lightning_nd.pipeline_parallel.stage import PipelineStages, StageModule
from lightning_nd.tensor_parallel.apply.model import apply_tp

log = logging.getLogger("lightning_nd")


@dataclass
class ParallelizeReport:
    """What the composer applied (the Layout's techniques, in order) and, under pp, this rank's stages."""

    applied: list[Technique] = field(default_factory=list)
    stages: list[StageModule] = field(default_factory=list)
    module: nn.Module | None = None

    def lines(self) -> list[str]:
        return [technique.describe() for technique in self.applied]


def parallelize(
    module: nn.Module,
    mesh: NDMesh,
    layout: Layout,
    *,
    forward_methods: Sequence[str] = (),
    styles: Mapping[str, object] | None = None,
) -> ParallelizeReport:
    """Apply ``layout`` to ``module`` in place.

    Under pp the model is split first (each stage is then parallelized on its own, as a model of
    its own) and the LightningModule's model attribute becomes this rank's `PipelineStages`.
    ``styles``: torch `ParallelStyle` objects of an explicit ``tp_plan`` (the Layout names them only).
    """
    report = ParallelizeReport(module=module)
    steps = {technique.technique: technique for technique in layout.techniques}
    tp_entries = {entry.module: (styles or {}).get(entry.module, entry.style) for entry in layout.tp}
    blocks = [(name, get_submodule(module, name)) for name in layout.blocks]
    if layout.pipeline is None:
        if "expert_parallel" in steps or "expert_tensor_parallel" in steps:
            _apply_experts(module, mesh, layout, report, steps)
        if "context_parallel" in steps:
            attach_position_hooks(fsdp_root(module), layout.options.cp_positions)
            _done(report, steps["context_parallel"])
        _apply(module, blocks, tp_entries or None, mesh, layout, report, steps, forward_methods=forward_methods)
        return report
    _disable_kv_cache(module)
    plan = layout.pipeline
    stages = build_stages(module, plan, mesh.local_rank("pp"))
    _done(report, steps["pipeline_split"])
    for index, stage in enumerate(stages):
        quiet = index > 0
        if "expert_parallel" in steps or "expert_tensor_parallel" in steps:
            _apply_experts(stage, mesh, layout, report, steps, quiet=quiet)
        if "context_parallel" in steps:
            attach_position_hooks(stage.module, layout.options.cp_positions)
            if not quiet:
                _done(report, steps["context_parallel"])
        entries = stage_tp_entries(tp_entries, plan.attribute, stage) if tp_entries else None
        _apply(stage, stage_blocks(stage), entries, mesh, layout, report, steps, root_unit=stage, quiet=quiet)
        stage.attach()
    setattr(module, plan.attribute, PipelineStages(stages))
    report.stages = stages
    return report


def _apply(
    module: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    tp_entries: dict[str, object] | None,
    mesh: NDMesh,
    layout: Layout,
    report: ParallelizeReport,
    steps: dict[str, Technique],
    *,
    forward_methods: Sequence[str] = (),
    root_unit: nn.Module | None = None,
    quiet: bool = False,
) -> None:
    """TP -> AC -> compile -> FSDP on one model (or one pipeline stage)."""
    options = layout.options
    names, block_modules = [name for name, _ in blocks], [block for _, block in blocks]
    done = (lambda technique: None) if quiet else (lambda technique: _done(report, technique))  # noqa: E731
    if tp_entries is not None and "tensor_parallel" in steps:
        apply_tp(module, mesh["tp"], entries_held_here(module, tp_entries),
                 sequence_parallel=options.sequence_parallel, loss_parallel=options.loss_parallel, block_names=names)
        done(steps["tensor_parallel"])
    if "activation_checkpointing" in steps:
        _disable_kv_cache(module)
        apply_ac(block_modules, options.activation_checkpointing)
        done(steps["activation_checkpointing"])
    if "compile" in steps and options.compile:
        apply_compile(block_modules, options.compile)
        done(steps["compile"])
    for kind in ("fsdp", "hsdp"):
        if kind in steps:
            dtype = lambda name: getattr(torch, name) if name else None  # noqa: E731
            apply_fsdp(
                module, block_modules, mesh[kind], zero_stage=options.zero_stage,
                param_dtype=dtype(options.param_dtype), reduce_dtype=dtype(options.reduce_dtype),
                cpu_offload=options.cpu_offload, forward_methods=forward_methods, root_unit=root_unit,
                **_expert_sharding(module, mesh, layout),
            )
            done(steps[kind])


def _expert_sharding(module: nn.Module, mesh: NDMesh, layout: Layout) -> dict:
    """Under ep, how FSDP treats the experts: sharded over the ranks holding the same experts when there are
    several, else left alone (one rank per expert: nothing to average)."""
    experts = expert_modules(module)
    if not experts or not layout.experts:  # none, or split over tp only: FSDP shards them with their blocks
        return {}
    if layout.experts[0].sharded_over is not None:
        return {"experts": experts, "expert_mesh": mesh["expert_dp"]}
    return {"ignored_params": set(expert_parameters(module))}


def _apply_experts(module: nn.Module, mesh: NDMesh, layout: Layout, report: ParallelizeReport,
                   steps: dict[str, Technique], quiet: bool = False) -> None:
    """Experts split by expert over ep (their gradient sums scaled to means), each expert split over tp (expert
    tensor parallelism: the plan splits all experts modules or none), or both (a 2-D (ep, tp) mesh)."""
    ep, etp = steps.get("expert_parallel"), steps.get("expert_tensor_parallel")
    if ep is not None:
        names = apply_ep(module, mesh["ep_tp"] if etp is not None else mesh["ep"])
        for experts in expert_modules(module):
            experts.grad_scale = 1.0 / layout.dims["ep"]  # the ep group's tokens add up; dense gradients are means
    else:
        names = apply_ep(module, None, mesh["tp"])
    if not quiet and names:
        for technique in (ep, etp):
            if technique is not None:
                _done(report, technique)


def _disable_kv_cache(module: nn.Module) -> None:
    """A KV cache filled during forward changes what recomputation sees (Hugging Face models keep
    ``config.use_cache=True`` even in training); their own gradient checkpointing turns it off too."""
    for name, submodule in module.named_modules():
        config = getattr(submodule, "config", None)
        if config is not None and getattr(config, "use_cache", False) is True:
            config.use_cache = False
            log.info("Set `%s.config.use_cache=False`: a KV cache breaks activation recomputation", name or "model")


def _done(report: ParallelizeReport, technique: Technique) -> None:
    report.applied.append(technique)
    log.info(technique.describe())
