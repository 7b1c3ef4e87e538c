"""Where a tensor-parallel plan comes from: `resolve.py` runs the passes in order (declared, names, structure,
keep-whole, checks), each pass a file named for what it reads; family-specific passes are `mla.py`, `ssm.py` and
`stacked_experts.py`."""

from lightning_nd.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "resolve_tp_plan": "lightning_nd.tensor_parallel.infer.resolve",
    },
)
