"""Style names -> torch `ParallelStyle`s: ``style_for(name, sequence_parallel, loss_parallel, input_shared)``, one
factory per style of the table in `lightning_nd/tensor_parallel/styles.py`. The styles torch does not have are in
`linear.py` (linear and embedding layers), `packed_heads.py` (a fused ``[q; k; v]`` sized by head counts),
`whole.py` (modules kept whole, per-head vectors, the SP norm), `attention.py`, `experts.py` and `stacked_experts.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from lightning_nd.tensor_parallel.apply.attention import MultiheadAttentionParallel
from lightning_nd.tensor_parallel.apply.experts import TransposedExpertsParallel
from lightning_nd.tensor_parallel.apply.linear import (
    Conv1DRowwiseParallel,
    EmbeddingRowwiseParallel,
    FusedColwiseParallel,
    PerHeadRowwiseParallel,
    RowwiseSharedOutput,
)
from lightning_nd.tensor_parallel.apply.packed_heads import PackedHeadsColwise, PackedHeadsRowwise
from lightning_nd.tensor_parallel.apply.stacked_experts import StackedColwise, StackedRowwise
from lightning_nd.tensor_parallel.apply.whole import (
    PerHeadParameters,
    ReplicatedPartialGrad,
    ShardingSequenceParallel,
    WholeOnSharedInput,
)
from lightning_nd.tensor_parallel.infer.fused_heads import HeadLayout
from lightning_nd.tensor_parallel.styles import PACKED_PARTS, STACKED_STYLES

SEQUENCE_DIM = 1


@dataclass(frozen=True)
class StyleMode:
    """What a style's factory needs of the run: the layouts SP and loss parallel give, MLA's rotary width and the
    head counts of the module above a layer split by them."""

    residual: Placement
    """The residual stream's layout: sequence shards under SP, else whole."""
    colwise_input: Placement
    loss_parallel: bool
    rope_dim: int
    heads: HeadLayout | None


FACTORIES: dict[str, Callable[[StyleMode], ParallelStyle]] = {
    "colwise": lambda mode: FusedColwiseParallel(input_layouts=mode.colwise_input),
    "rowwise": lambda mode: Conv1DRowwiseParallel(output_layouts=mode.residual,
                                                  use_local_output=mode.residual.is_replicate()),
    "packed_colwise": lambda mode: FusedColwiseParallel(parts=PACKED_PARTS["packed_colwise"],
                                                         input_layouts=mode.colwise_input),
    "packed_qkv": lambda mode: FusedColwiseParallel(parts=PACKED_PARTS["packed_qkv"], input_layouts=mode.colwise_input),
    "packed_heads": lambda mode: PackedHeadsColwise(layout=_heads(mode), input_layouts=mode.colwise_input),
    "rowwise_packed_heads": lambda mode: PackedHeadsRowwise(layout=_heads(mode), output_layouts=mode.residual,
                                                            use_local_output=mode.residual.is_replicate()),
    "colwise_rep": lambda mode: FusedColwiseParallel(input_layouts=mode.colwise_input, output_layouts=Replicate()),
    "rowwise_split_input": lambda mode: Conv1DRowwiseParallel(input_layouts=Replicate(), output_layouts=mode.residual,
                                                              use_local_output=mode.residual.is_replicate()),
    # Replicated even under SP: code between the embedding and the first block (positions, masks) sees an ordinary
    # full tensor; the first block's pre-hook slices it (no communication).
    "embedding_rowwise": lambda mode: EmbeddingRowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda mode: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "colwise_gather_output": lambda mode: (
        FusedColwiseParallel(input_layouts=mode.residual, output_layouts=Shard(-1), use_local_output=False)
        if mode.loss_parallel else FusedColwiseParallel(input_layouts=mode.residual, output_layouts=Replicate())),
    "sequence_parallel": lambda mode: ShardingSequenceParallel(sequence_dim=SEQUENCE_DIM),
    "replicated_with_grad_allreduce": lambda mode: ReplicatedPartialGrad(),
    "mla_kv_a_proj": lambda mode: WholeOnSharedInput(rope_dim=mode.rope_dim),
    "down_projection": lambda mode: WholeOnSharedInput(),
    "per_head_params": lambda mode: PerHeadParameters(vectors_only=False),
    "per_head_rowwise": lambda mode: PerHeadRowwiseParallel(),
    "rowwise_shared_output": lambda mode: RowwiseSharedOutput(),
    "per_channel_vectors": lambda mode: PerHeadParameters(vectors_only=True),
    "stacked_colwise": lambda mode: StackedColwise(parts=STACKED_STYLES["stacked_colwise"][1]),
    "stacked_packed_colwise": lambda mode: StackedColwise(parts=STACKED_STYLES["stacked_packed_colwise"][1]),
    "stacked_rowwise": lambda mode: StackedRowwise(),
    "multihead_attention": lambda mode: MultiheadAttentionParallel(),
    "transposed_experts": lambda mode: TransposedExpertsParallel(),
}
"""Style name -> its torch `ParallelStyle`, one per style of `lightning_nd.tensor_parallel.styles` that a module is
given (``replicate``, ``channel_mixer`` and ``channel_params`` are applied by `apply_tp` itself)."""


def _heads(mode: StyleMode) -> HeadLayout:
    assert mode.heads is not None, "a style split by head counts is given its module's (`apply_tp`)"
    return mode.heads


def style_for(name: str, sequence_parallel: bool, loss_parallel: bool, input_shared: bool = False,
              rope_dim: int = 0, heads: HeadLayout | None = None) -> ParallelStyle:
    """The torch `ParallelStyle` for a style name, in the current SP / loss-parallel mode.

    ``input_shared``: the enclosing module hands its projections one replicated input (see `apply_tp`).
    ``rope_dim``: for ``mla_kv_a_proj``, the width of the shared rotary key at the end of its output.
    ``heads``: for ``packed_heads`` and ``rowwise_packed_heads``, the head counts of the module above the layer.
    """
    residual = Shard(SEQUENCE_DIM) if sequence_parallel else Replicate()
    # Colwise layers declare the layout they receive: torch redistributes by the declared layout, not
    # by the actual placement of a DTensor input, so a sequence-sharded input must be declared as such.
    # A shared replicated input is declared Replicate: a (no-op) redistribute would all-reduce each
    # projection's input gradient in backward instead of leaving one reduction to the shared input.
    colwise_input = Replicate() if input_shared else residual
    if name not in FACTORIES:
        raise ValueError(f"Unknown TP style {name!r}.")
    return FACTORIES[name](StyleMode(residual, colwise_input, loss_parallel, rope_dim, heads))
