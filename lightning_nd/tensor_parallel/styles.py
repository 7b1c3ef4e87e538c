"""The tensor-parallel styles by name, and what each does, in one table: the plan's passes, its checks, the
arithmetic of what each rank holds and the application all read a style's facts from here.

    STYLE_FACTS["packed_colwise"].parts   # 2: a fused [gate; up] weight, each part split alone

How a style is applied (its torch `ParallelStyle`) is `apply/styles.py`, one factory per name of this table.
Pure: no torch.distributed, so the planning imports it before any process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Style:
    """What one style does to the module it names."""

    weight: Literal["colwise", "rowwise"] | None = None
    """How it splits a linear (or embedding) weight: by output features (``colwise``), by input features
    (``rowwise``), or not as a plain weight (None)."""
    parts: int = 1
    """Parts packed in one weight ([gate; up]: 2, [q; k; v]: 3), each split alone so rank r holds part r of each."""
    stacked: tuple[int, int] | None = None
    """Experts stored as one ``[E, out, in]`` weight: (the dim split, the packed parts)."""
    sharded_output: bool = False
    """Its output stays split (heads or features per rank): a rowwise layer must take it back."""
    shards: bool = False
    """It splits a block's work over tp; a plan with none of these would split nothing and is refused."""
    owns: bool = False
    """It splits the module's own parameters only, not its children's."""
    whole: bool = False
    """It keeps the module whole on every tp rank (its gradient summed where it is partial)."""
    outer: bool = False
    """It names a module outside the blocks: an embedding or the output head (a vocabulary split)."""
    by_heads: bool = False
    """It splits by the head counts of the module above it (a fused ``[q; k; v]`` of unequal parts and its output
    projection, `lightning_nd/tensor_parallel/infer/fused_heads.py`)."""


STYLE_FACTS: dict[str, Style] = {
    "colwise": Style(weight="colwise", sharded_output=True, shards=True),
    "rowwise": Style(weight="rowwise", shards=True),
    "packed_colwise": Style(weight="colwise", parts=2, sharded_output=True, shards=True),
    "packed_qkv": Style(weight="colwise", parts=3, sharded_output=True, shards=True),
    "packed_heads": Style(weight="colwise", parts=3, sharded_output=True, shards=True, by_heads=True),
    "rowwise_packed_heads": Style(weight="rowwise", shards=True, by_heads=True),
    "colwise_rep": Style(weight="colwise", shards=True),
    "rowwise_split_input": Style(weight="rowwise", shards=True),
    "embedding_rowwise": Style(weight="rowwise", outer=True),
    "embedding_colwise": Style(weight="colwise", outer=True),
    "colwise_gather_output": Style(weight="colwise", outer=True),
    "sequence_parallel": Style(),
    "replicated_with_grad_allreduce": Style(whole=True),
    "mla_kv_a_proj": Style(),
    "down_projection": Style(whole=True),
    "per_head_params": Style(owns=True),
    "per_head_rowwise": Style(weight="rowwise"),
    "rowwise_shared_output": Style(weight="rowwise"),
    "channel_mixer": Style(shards=True, owns=True),
    "channel_params": Style(),
    "per_channel_vectors": Style(owns=True),
    "stacked_colwise": Style(stacked=(1, 1), shards=True),
    "stacked_packed_colwise": Style(stacked=(1, 2), shards=True),
    "stacked_rowwise": Style(stacked=(2, 1), shards=True),
    "multihead_attention": Style(shards=True),
    "transposed_experts": Style(shards=True),
    "replicate": Style(whole=True),
}
STYLES = tuple(STYLE_FACTS)
"""Every style name a plan may use, in the order the refusal of an unknown one lists them."""


def style_has(style: object, **wanted: object) -> bool:
    """Whether a style name's facts have every given value, e.g. ``style_has(style, whole=True)``; False for a torch
    `ParallelStyle` object or a name that is no style."""
    facts = STYLE_FACTS.get(style) if isinstance(style, str) else None
    return facts is not None and all(getattr(facts, key) == value for key, value in wanted.items())


PACKED_PARTS: dict[object, int] = {name: s.parts for name, s in STYLE_FACTS.items() if s.parts > 1}
STACKED_STYLES = {name: s.stacked for name, s in STYLE_FACTS.items() if s.stacked is not None}
