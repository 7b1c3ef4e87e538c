"""Expert parallelism: each rank of an ep group holds E/ep of a layer's experts and tokens travel to them
(`dispatch.py`). Experts split over tp instead (expert tensor parallelism) are a tensor-parallel style:
`lightning_nd/tensor_parallel/apply/experts.py`."""

from lightning_nd.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "apply_ep": "lightning_nd.expert_parallel.dispatch",
    },
)
