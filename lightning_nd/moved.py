"""Modules that moved, still importable under their old dotted paths: each warns once (a `FutureWarning` naming its
new path) and is the same module object as the new one, so old imports, pickles and ``mock.patch`` targets work.

    import lightning_nd.layout.dims   # FutureWarning: `lightning_nd.layout.dims` moved to `lightning_nd.mesh.dims`
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED = {
    "lightning_nd.layout.batch": "lightning_nd.model.batch",
    "lightning_nd.layout.declared": "lightning_nd.tensor_parallel.infer.declared",
    "lightning_nd.layout.dims": "lightning_nd.mesh.dims",
    "lightning_nd.layout.forward_source": "lightning_nd.tensor_parallel.infer.forward_source",
    "lightning_nd.layout.hf_styles": "lightning_nd.tensor_parallel.infer.hugging_face",
    "lightning_nd.layout.latent": "lightning_nd.tensor_parallel.infer.mla",
    "lightning_nd.layout.per_feature": "lightning_nd.tensor_parallel.infer.per_feature",
    "lightning_nd.layout.pipeline_split": "lightning_nd.pipeline_parallel.split",
    "lightning_nd.layout.positions": "lightning_nd.context_parallel.positions",
    "lightning_nd.layout.roles": "lightning_nd.mesh.roles",
    "lightning_nd.layout.schedules": "lightning_nd.pipeline_parallel.schedules",
    "lightning_nd.layout.ssm_plan": "lightning_nd.tensor_parallel.infer.ssm",
    "lightning_nd.layout.stacked_plan": "lightning_nd.tensor_parallel.infer.stacked_experts",
    "lightning_nd.layout.structure": "lightning_nd.model.structure",
    "lightning_nd.layout.structure_plan": "lightning_nd.tensor_parallel.infer.structure",
    "lightning_nd.layout.tp_checks": "lightning_nd.tensor_parallel.infer.checks",
    "lightning_nd.layout.tp_patterns": "lightning_nd.tensor_parallel.infer.names",
    "lightning_nd.layout.tp_plan": "lightning_nd.tensor_parallel.infer.resolve",
    "lightning_nd.layout.tp_suggest": "lightning_nd.tensor_parallel.infer.suggest",
    "lightning_nd.layout.tp_whole": "lightning_nd.tensor_parallel.infer.keep_whole",
    "lightning_nd.nn.attention_blocks": "lightning_nd.context_parallel.block_kernels",
    "lightning_nd.nn.block_pairs": "lightning_nd.context_parallel.block_pairs",
    "lightning_nd.nn.ring_attention": "lightning_nd.context_parallel.ring_attention",
    "lightning_nd.parallel.context": "lightning_nd.context_parallel",
    "lightning_nd.parallel.context.region": "lightning_nd.context_parallel.region",
    "lightning_nd.parallel.context.sharding": "lightning_nd.context_parallel.sharding",
    "lightning_nd.parallel.expert": "lightning_nd.expert_parallel.dispatch",
    "lightning_nd.parallel.expert_tp": "lightning_nd.tensor_parallel.apply.experts",
    "lightning_nd.parallel.forward_views": "lightning_nd.tensor_parallel.apply.forward_views",
    "lightning_nd.parallel.head_inputs": "lightning_nd.tensor_parallel.apply.head_inputs",
    "lightning_nd.parallel.pipeline": "lightning_nd.pipeline_parallel",
    "lightning_nd.parallel.pipeline.aux_losses": "lightning_nd.pipeline_parallel.aux_losses",
    "lightning_nd.parallel.pipeline.build": "lightning_nd.pipeline_parallel.build",
    "lightning_nd.parallel.pipeline.forward_only": "lightning_nd.pipeline_parallel.forward_only",
    "lightning_nd.parallel.pipeline.schedule": "lightning_nd.pipeline_parallel.runner",
    "lightning_nd.parallel.pipeline.shape_inference": "lightning_nd.pipeline_parallel.shape_inference",
    "lightning_nd.parallel.pipeline.stage": "lightning_nd.pipeline_parallel.stage",
    "lightning_nd.parallel.pipeline.tied": "lightning_nd.pipeline_parallel.tied",
    "lightning_nd.parallel.tensor": "lightning_nd.tensor_parallel.apply.model",
    "lightning_nd.parallel.tp_attention": "lightning_nd.tensor_parallel.apply.attention",
    "lightning_nd.parallel.tp_channels": "lightning_nd.tensor_parallel.apply.ssm_channels",
    "lightning_nd.parallel.tp_dropout": "lightning_nd.tensor_parallel.apply.dropout",
    "lightning_nd.parallel.tp_stacked": "lightning_nd.tensor_parallel.apply.stacked_experts",
    "lightning_nd.parallel.tp_styles": "lightning_nd.tensor_parallel.apply.styles",
    "lightning_nd.plan.dry_run": "lightning_nd.planner.dry_run",
    "lightning_nd.plan.params_only": "lightning_nd.planner.params_only",
    "lightning_nd.plan.planner": "lightning_nd.planner.run",
    "lightning_nd.plan.search": "lightning_nd.planner.search",
    "lightning_nd.plan.shortlist": "lightning_nd.planner.shortlist",
    "lightning_nd.plan.source": "lightning_nd.planner.source",
    "lightning_nd.plan.table": "lightning_nd.planner.table",
    "lightning_nd.runtime.mesh": "lightning_nd.mesh.build",
    "lightning_nd.strategy.own_steps": "lightning_nd.pipeline_parallel.own_steps",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        return None


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds an old path of `MOVED` as an alias of its new module."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        # stacklevel=2: the warnings module skips importlib's own frames, so this names the line that imported it
        warnings.warn(f"`{fullname}` moved to `{new}`; import it from there.", FutureWarning, stacklevel=2)
        module = importlib.import_module(new)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new), is_package=hasattr(module, "__path__"))


def install() -> None:
    """Put the finder first, once: an old path whose folder still exists must not be found as a fresh module."""
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
