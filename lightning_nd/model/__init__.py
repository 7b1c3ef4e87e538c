"""What a model looks like to every technique: its repeated blocks, attention, head counts and experts
(`structure.py`), and what a batch of it holds (`batch.py`). No technique of its own."""

from lightning_nd.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "find_blocks": "lightning_nd.model.structure",
        "read_model_facts": "lightning_nd.model.structure",
    },
)
