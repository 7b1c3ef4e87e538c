"""Tensor (+ sequence) parallelism: which style splits each module (`infer/`, pure: no process group) and applying
those styles to a model (`apply/`); the autograd collectives both sides of a split need are in `communication.py`."""

from lightning_nd.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "resolve_tp_plan": "lightning_nd.tensor_parallel.infer.resolve",
        "apply_tp": "lightning_nd.tensor_parallel.apply.model",
    },
)
