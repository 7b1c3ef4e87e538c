"""The routing analysis on hand-built counts (diagnostics/analysis/routing.py): the reductions over ranks and layers,
with unequal layers and ranks so that a sum or an average over the wrong axis fails, the per-layer statistics, the
load per expert-parallel rank, and the collapse and dead-expert verdicts (with "not enough tokens")."""

from __future__ import annotations

import math

import pytest

from diagnostics.analysis.routing import LayerLoad, advice, ep_rank_load, merge_ranks, verdict


def test_merge_sums_batch_ranks_counts_one_rank_per_tp_group_and_gathers_pipeline_stages():
    # 6 ranks: pp=2 stages x (dp=... ) with tp=... : stage 0 holds layers a, b on ranks 0-3 (tp pairs 0/1, 2/3);
    # stage 1 holds layer c on ranks 4, 5 (a tp pair). Each tp pair routes alike; the pairs see different tokens.
    records = {
        0: {"a": [3, 1, 0, 0], "b": [1, 1, 1, 1]}, 1: {"a": [3, 1, 0, 0], "b": [1, 1, 1, 1]},
        2: {"a": [0, 2, 2, 0], "b": [0, 0, 4, 0]}, 3: {"a": [0, 2, 2, 0], "b": [0, 0, 4, 0]},
        4: {"c": [5, 0, 0, 0, 1, 2]}, 5: {"c": [5, 0, 0, 0, 1, 2]},
    }
    merged = merge_ranks(records, counted=[0, 2, 4])
    assert merged == {"a": [3, 3, 2, 0], "b": [1, 1, 5, 1], "c": [5, 0, 0, 0, 1, 2]}
    assert merge_ranks(records, counted=range(6))["a"] == [6, 6, 4, 0]  # what counting the tp copies would give
    with pytest.raises(ValueError, match="rank 2 counts 3 experts in `a`, others 4"):
        merge_ranks({0: {"a": [1, 2, 3, 4]}, 2: {"a": [1, 2, 3]}}, counted=[0, 2])


def test_layer_statistics_by_hand():
    layer = LayerLoad("l", (4, 3, 1, 0), top_k=2, dropped=2)  # 4 tokens x top-2 = 8 assignments kept
    assert layer.total == 8 and layer.mean == 2.0
    assert layer.max_over_mean == 2.0
    assert layer.cv == pytest.approx(math.sqrt((4 + 1 + 1 + 4) / 4) / 2)
    shares = (0.5, 0.375, 0.125)
    assert layer.entropy == pytest.approx(-sum(s * math.log(s) for s in shares) / math.log(4))
    assert layer.dropped_fraction == pytest.approx(2 / 10)
    assert layer.skew == pytest.approx(1.0)  # expert 0 took every token: the most one expert can take under top-2
    even = LayerLoad("e", (10, 10, 10, 10), top_k=2)
    assert (even.max_over_mean, even.cv, even.entropy, even.skew) == (1.0, 0.0, pytest.approx(1.0), 0.0)


def test_load_per_ep_rank_and_the_slowest_over_unequal_layers():
    assert ep_rank_load([5, 1, 1, 1, 2, 2, 2, 2], ep=2) == [8, 8]
    assert ep_rank_load([5, 1, 1, 1, 2, 2, 2, 2], ep=4) == [6, 2, 4, 4]
    with pytest.raises(ValueError, match="ep=3 does not divide the 8 experts"):
        ep_rank_load([1] * 8, ep=3)
    layers = [LayerLoad("a", (30, 30, 10, 10), top_k=1), LayerLoad("b", (5, 5, 5, 25), top_k=1)]
    found = verdict(layers, ep=2)  # rank 0: 60 + 10 = 70, rank 1: 20 + 30 = 50; mean 60
    assert found.slowest_ep_rank == (0, pytest.approx(70 / 60))
    assert verdict(layers[1:], ep=2).slowest_ep_rank == (1, pytest.approx(30 / 20))


def test_a_collapse_and_a_dead_expert_are_named_and_a_balanced_router_gets_neither():
    collapsed = LayerLoad("model.layers.0.mlp", (90, 40, 30, 40, 0, 0, 0, 0), top_k=2)  # 100 tokens
    assert collapsed.skew == pytest.approx((0.45 - 0.125) / (0.5 - 0.125))
    dead = LayerLoad("model.layers.1.mlp", (40, 40, 40, 40, 40, 0, 0, 0), top_k=2)
    balanced = LayerLoad("model.layers.2.mlp", (26, 24, 25, 25, 25, 25, 24, 26), top_k=2)
    found = verdict([collapsed, dead, balanced])
    assert found.collapsed == (("model.layers.0.mlp", 0, 0.45),)
    assert found.dead == (("model.layers.0.mlp", (4, 5, 6, 7)), ("model.layers.1.mlp", (5, 6, 7)))
    assert not found.healthy and "aux_loss_coef" in " ".join(advice(found))
    healthy = verdict([balanced])
    assert healthy.healthy and advice(healthy) == () and healthy.too_few == ()


def test_too_few_tokens_to_call_an_expert_dead():
    sparse = LayerLoad("l", (3, 2, 1, 0), top_k=1)  # each expert due 1.5 assignments
    found = verdict([sparse])
    assert found.dead == () and found.too_few == ("l",)
