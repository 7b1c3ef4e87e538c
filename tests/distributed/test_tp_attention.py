"""``nn.MultiheadAttention`` split by heads over 2 ranks computes what the whole module does, for every way it can
be built (batch or sequence first, its own key/value widths, ``bias_k``/``bias_v``, ``add_zero_attn``, no bias)
and called (self- or cross-attention, causal, 3-D boolean masks, key padding, averaged or per-head weights, a
sequence-sharded input): output, attention weights, input and parameter gradients, float32; and Lightning's demo
`Transformer` (encoder, decoder, cross-attention) planned with no plan of ours, float64. Beside them, on the same
ranks: an MLP's own per-feature vectors (nGPT's scales) split with its features."""

from __future__ import annotations

import pytest

from tests.distributed.tp_attention_ranks import CASES
from tests.launcher import launch


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return launch("tests.distributed.tp_attention_ranks:compare", 2, tmp_path_factory.mktemp("mha"), timeout=120)


@pytest.mark.parametrize("case", [*CASES, "lightning_demo_transformer", "per_feature_scales"])
def test_multihead_attention_split_by_heads_matches_the_whole_module(per_rank, case):
    for rank, results in enumerate(per_rank):
        differences = results[case]
        assert differences.pop("split") == 1.0, f"rank {rank}: the module was not split"
        tolerance = 1e-12 if case in ("lightning_demo_transformer", "per_feature_scales") else 2e-5  # float64 / 32
        assert max(differences.values()) < tolerance, (rank, differences)


def test_a_whole_child_whose_output_carries_a_gradient_stops_at_the_first_forward(per_rank):
    for rank, results in enumerate(per_rank):
        assert results["whole_child_with_gradient"] == {"refused": 1.0}, rank
