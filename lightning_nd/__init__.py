"""lightning-nd: N-D parallel training (FSDP2/HSDP x TP x PP x CP x EP) as an ordinary Lightning run.

``Trainer(strategy=NDParallel(dp_shard=2, tp=2))`` or, after ``import lightning_nd``, ``Trainer(strategy="nd")``.
``plan_layout`` (and ``python -m lightning_nd.plan``) shows what a layout does before any process starts.

Importing the package loads no Lightning and no transformers: each name below is imported when first used, and
``strategy="nd"`` is registered when Lightning's strategies are (`strategy/registration.py`).
"""

from __future__ import annotations

from lightning_nd import moved
from lightning_nd.exports import lazy_exports
from lightning_nd.strategy.registration import register_when_imported

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Layout": "lightning_nd.layout.record",
        "NDMesh": "lightning_nd.mesh.build",
        "NDParallel": "lightning_nd.strategy.nd_parallel",
        "ParallelConfig": "lightning_nd.layout.options",
        "ParallelDims": "lightning_nd.mesh.dims",
        "TP_STYLES": "lightning_nd.tensor_parallel.styles:STYLES",
        "parallelize": "lightning_nd.parallel.compose",
        "plan_layout": "lightning_nd.layout.plan",
    },
)

register_when_imported()
moved.install()
