"""A tensor-parallel plan applied: `model.py` walks the plan, `styles.py` turns a style name into the torch
`ParallelStyle` that splits one module; the other files are the styles torch does not have."""

from lightning_nd.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "apply_tp": "lightning_nd.tensor_parallel.apply.model",
        "style_for": "lightning_nd.tensor_parallel.apply.styles",
    },
)
