"""The Lightning glue: `NDParallel` (`nd_parallel.py`: its keywords; `hooks.py`: what Lightning calls) and the
collaborators its hooks call (run plan, steps, pipeline engine, checkpointer, failure monitor, events)."""

from lightning_nd.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {"NDParallel": "lightning_nd.strategy.nd_parallel"})
