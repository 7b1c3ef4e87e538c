"""Context parallelism: the global positions a shard sees (`positions.py`, pure), zigzag sequence sharding
(`sharding.py`), the region that routes attention to ring attention (`region.py`), and ring attention itself with its
block kernels; the ring's autograd rotation is in `communication.py`."""

from lightning_nd.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "shard_batch": "lightning_nd.context_parallel.sharding",
        "ring_attention": "lightning_nd.context_parallel.ring_attention",
    },
)
