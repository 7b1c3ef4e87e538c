"""The N-D device mesh: the dims' sizes (`dims.py`), the groups each technique talks over (`roles.py`), and the
`DeviceMesh` built from them (`build.py`)."""

from lightning_nd.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ParallelDims": "lightning_nd.mesh.dims",
        "NDMesh": "lightning_nd.mesh.build",
    },
)
