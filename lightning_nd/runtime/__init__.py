"""Torch-level machinery the strategy runs on: materialising meta models (`materialize.py`), clipping by the global
norm (`clip.py`), timeouts, the dead-rank watchdog and the profiler labels. No Lightning here."""

from lightning_nd.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "materialize": "lightning_nd.runtime.materialize",
        "global_grad_norm": "lightning_nd.runtime.clip",
    },
)
