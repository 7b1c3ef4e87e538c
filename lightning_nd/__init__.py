"""lightning-nd: N-D parallel training (FSDP2/HSDP x TP x PP x CP x EP) as an ordinary Lightning run.

``Trainer(strategy=NDParallel(dp_shard=2, tp=2))`` or, after ``import lightning_nd``, ``Trainer(strategy="nd")``.
``plan_layout`` (and ``python -m lightning_nd.planner``) shows what a layout does before any process starts.

Importing the package loads no Lightning and no transformers: each name below is imported when first used, and
``strategy="nd"`` is registered when Lightning's strategies are (`strategy/registration.py`).
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_nd import moved
from lightning_nd.strategy.registration import register_when_imported

_PUBLIC = {
    "Layout": ("lightning_nd.layout.record", "Layout"),
    "NDMesh": ("lightning_nd.mesh.build", "NDMesh"),
    "NDParallel": ("lightning_nd.strategy.nd_parallel", "NDParallel"),
    "ParallelConfig": ("lightning_nd.layout.options", "ParallelConfig"),
    "ParallelDims": ("lightning_nd.mesh.dims", "ParallelDims"),
    "TP_STYLES": ("lightning_nd.tensor_parallel.styles", "STYLES"),
    "parallelize": ("lightning_nd.parallel.compose", "parallelize"),
    "plan_layout": ("lightning_nd.layout.plan", "plan_layout"),
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'lightning_nd' has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


register_when_imported()
moved.install()
