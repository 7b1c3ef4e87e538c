"""The parallel layout of a run as a markdown card: what each dim splits and what was applied."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

DIM_MEANING = {
    "pp": "layers into pipeline stages",
    "dp_replicate": "the batch, over full model replicas",
    "dp_shard": "the batch, with parameters/gradients/optimizer state sharded",
    "cp": "the sequence (context)",
    "tp": "every weight matrix",
    "ep": "the MoE experts (ranks borrowed from dp_shard x cp)",
}


def layout_markdown(sizes: Mapping[str, int], applied: Sequence[str], rank_table: str) -> str:
    """A card with one row per dim (size, what it splits), the techniques applied, and rank coordinates."""
    rows = [f"| `{name}` | {size} | {DIM_MEANING.get(name, '')} |" for name, size in sizes.items() if name in DIM_MEANING]
    lines = ["### Parallel layout", "", "| dim | size | splits |", "|---|---|---|", *rows, ""]
    lines += ["### Applied", ""] + [f"- {line}" for line in applied] + [""] if applied else []
    lines += ["### Rank coordinates", "", rank_table]
    return "\n".join(lines)
