"""Reference layers that parallelize cleanly (no Lightning imports): the mixture-of-experts block `MoE`."""

from lightning_nd.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {"MoE": "lightning_nd.nn.moe"})
