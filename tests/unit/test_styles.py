"""Style names become the torch `ParallelStyle` the mode needs, one factory per style of the facts table; the layout
card reads as a table."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from examples.lit import CausalLM
from lightning_nd import ParallelConfig, ParallelDims, plan_layout
from lightning_nd.layout.describe import layout_markdown
from lightning_nd.tensor_parallel.apply.styles import FACTORIES, style_for
from lightning_nd.tensor_parallel.apply.whole import ShardingSequenceParallel
from lightning_nd.tensor_parallel.infer.checks import is_colwise
from lightning_nd.tensor_parallel.infer.fused_heads import HeadLayout
from lightning_nd.tensor_parallel.styles import STYLE_FACTS, STYLES, style_has
from tests.models import build


def test_colwise_styles_fan_out_heads():
    assert is_colwise("colwise") and is_colwise("packed_colwise") and is_colwise(ColwiseParallel())
    assert not is_colwise(ColwiseParallel(output_layouts=Replicate()))  # a gathered head, not heads
    assert not is_colwise("rowwise") and not is_colwise(RowwiseParallel()) and not is_colwise("colwise_gather_output")


def test_sequence_parallel_declares_sharded_inputs_and_outputs():
    # torch redistributes by the declared layout, so a sequence-sharded input must be declared as such.
    assert style_for("colwise", sequence_parallel=True, loss_parallel=False).input_layouts == (Shard(1),)
    assert style_for("colwise", sequence_parallel=False, loss_parallel=False).input_layouts == (Replicate(),)
    # Under a module that shares one gathered input, declaring Shard(1) would make each projection
    # all-reduce its input gradient (measured 1.8x the minimum SP traffic).
    assert style_for("colwise", True, False, input_shared=True).input_layouts == (Replicate(),)
    rowwise = style_for("rowwise", sequence_parallel=True, loss_parallel=False)
    assert rowwise.output_layouts == (Shard(1),) and rowwise.use_local_output is False
    assert isinstance(style_for("sequence_parallel", True, False), ShardingSequenceParallel)
    assert [style_for(name, False, False).parts for name in ("colwise", "packed_colwise", "packed_qkv")] == [1, 2, 3]


def test_loss_parallel_head_keeps_vocabulary_shards():
    head = style_for("colwise_gather_output", sequence_parallel=True, loss_parallel=True)
    assert head.output_layouts == (Shard(-1),) and head.use_local_output is False
    assert style_for("colwise_gather_output", False, False).output_layouts == (Replicate(),)


def test_layout_card_has_one_row_per_dim_and_the_applied_lines():
    layout = plan_layout(CausalLM(model=build("llama")), ParallelDims(dp_shard=2, tp=2, world_size=4), ParallelConfig())
    card = layout_markdown(layout, ["Applied FSDP (shard=2)"], "| rank |")
    assert "| `dp_shard` | 2 | the batch, with parameters/gradients/optimizer state sharded |" in card
    assert "- Applied FSDP (shard=2)" in card and card.endswith("| rank |\n")
    assert "| `model.layers.*.mlp.down_proj` | rowwise | pattern | 2 |" in card


def test_dropout_masks_differ_across_tp_ranks_only_where_activations_are_split():
    """Two tp ranks seeded alike: the split module (its own stream per rank) draws different masks, the
    replicated stream after it draws the same mask on both, as one process keeps its copies equal."""
    import torch
    from torch import nn

    from lightning_nd.tensor_parallel.apply.dropout import fork_rng_per_rank, has_dropout

    def masks(tp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        split, replicated = nn.Dropout(0.5), nn.Dropout(0.5)
        fork_rng_per_rank(split, tp_rank)
        ones = torch.ones(64)
        return split(ones), replicated(ones)

    (split0, after0), (split1, after1) = masks(0), masks(1)
    assert not torch.equal(split0, split1)
    assert torch.equal(after0, after1)
    assert has_dropout(nn.Sequential(nn.Dropout(0.1))) and not has_dropout(nn.Sequential(nn.Dropout(0.0)))


HEADS = HeadLayout(heads=4, groups=2, head_dim=8, holder="", attrs=("num_heads", "num_key_value_heads"))
"""The head counts `apply_tp` gives the styles split by them (``packed_heads``)."""


def test_every_style_of_the_facts_table_has_a_factory_or_is_applied_by_apply_tp():
    applied_by_apply_tp = {"replicate", "channel_mixer", "channel_params"}  # whole, or split by `ChannelMixer`
    assert set(FACTORIES) == set(STYLES) - applied_by_apply_tp
    for name in FACTORIES:
        for sequence_parallel in (False, True):
            for loss_parallel in (False, True):
                assert style_for(name, sequence_parallel, loss_parallel, rope_dim=4, heads=HEADS) is not None
    with pytest.raises(ValueError, match="Unknown TP style 'colwize'"):
        style_for("colwize", False, False)


def test_the_facts_agree_with_each_other():
    for name, style in STYLE_FACTS.items():
        assert not (style.whole and (style.shards or style.weight)), name
        assert style.parts == 1 or (style.weight == "colwise" and style.sharded_output), name
        assert not style.sharded_output or style.weight == "colwise", name
        assert not style.outer or (style.weight and not style.shards), name
    packed = style_for("packed_qkv", False, False)
    assert packed.parts == STYLE_FACTS["packed_qkv"].parts == 3
    assert {name for name in STYLES if style_has(name, whole=True)} == {"replicate", "replicated_with_grad_allreduce",
                                                                 "down_projection"}
    assert not style_has(ColwiseParallel(), weight="colwise") and not style_has("colwize")
