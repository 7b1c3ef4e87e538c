"""A Layout applied: the one composer (`compose.py`: every technique in one order), FSDP/HSDP (`fsdp.py`) and
activation checkpointing with compilation (`activation.py`)."""

from lightning_nd.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "parallelize": "lightning_nd.parallel.compose",
        "apply_fsdp": "lightning_nd.parallel.fsdp",
    },
)
