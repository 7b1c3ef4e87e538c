"""lightning-nd: N-D parallel training (FSDP2/HSDP x TP x ...) as an ordinary Lightning run.

``Trainer(strategy=NDParallel(dp_shard=2, tp=2))`` or, after ``import lightning_nd``, ``Trainer(strategy="nd")``.
"""

from lightning_nd.dims import ParallelDims
from lightning_nd.mesh import NDMesh
from lightning_nd.config import ParallelConfig
from lightning_nd.parallelize import parallelize
from lightning_nd.plans import STYLES as TP_STYLES
from lightning_nd.strategy import NDParallel

__all__ = ["NDMesh", "NDParallel", "ParallelConfig", "ParallelDims", "TP_STYLES", "parallelize"]
