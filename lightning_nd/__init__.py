"""lightning-nd: N-D parallel training (FSDP2/HSDP x TP x PP x CP x EP) as an ordinary Lightning run.

``Trainer(strategy=NDParallel(dp_shard=2, tp=2))`` or, after ``import lightning_nd``, ``Trainer(strategy="nd")``.
``plan_layout`` (and ``python -m lightning_nd.plan``) shows what a layout does before any process starts.
"""

from lightning_nd.layout.dims import ParallelDims
from lightning_nd.layout.options import ParallelConfig
from lightning_nd.layout.plan import plan_layout
from lightning_nd.layout.record import Layout
from lightning_nd.layout.tp_plan import STYLES as TP_STYLES
from lightning_nd.parallel.compose import parallelize
from lightning_nd.runtime.mesh import NDMesh
from lightning_nd.strategy.nd_parallel import NDParallel

__all__ = ["Layout", "NDMesh", "NDParallel", "ParallelConfig", "ParallelDims", "TP_STYLES", "parallelize",
           "plan_layout"]
