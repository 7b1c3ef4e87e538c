"""The routing analysis on hand-built counts (diagnostics/analysis/routing.py, routing_counts.py): the reduction over
ranks and layers, with unequal layers and ranks so that a sum or an average over the wrong axis fails, the per-layer
statistics, the load per expert-parallel rank, and the collapse and dead-expert verdicts (with "not enough tokens")."""

from __future__ import annotations

import math

import pytest

from diagnostics.analysis.routing import LayerLoad, across_layers, advice, ep_rank_load, interval, verdict
from diagnostics.analysis.routing_counts import Slot, Slots, counts_on_this_tp_rank, dropped_on_this_ep_rank
from diagnostics.records import RoutingInterval, from_json, to_json


def _summed(vectors):
    return [sum(column) for column in zip(*vectors)]


def test_the_sum_counts_batch_ranks_once_each_tp_copies_once_and_gathers_pipeline_stages():
    # 6 ranks, pp=2: stage 0 (ranks 0-3, tp pairs 0/1 and 2/3) holds layers a (4 experts) and b (4 experts, drops
    # reported); stage 1 (ranks 4, 5: a tp pair) holds c (6 experts). Each tp pair routes alike, the pairs see
    # different tokens.
    a, b, c = Slot("a", 4, 1, False), Slot("b", 4, 2, True), Slot("c", 6, 1, False)
    slots = Slots.of([[a, b], [a, b], [b, a], [a, b], [c], [c]])
    assert [s.layer for s in slots.slots] == ["a", "b", "c"] and slots.size == 6 + 6 + 8
    held = {
        0: {"a": ([3, 1, 0, 0], 4, 0), "b": ([1, 1, 1, 1], 2, 1)}, 2: {"a": ([0, 2, 2, 0], 4, 0),
                                                                      "b": ([0, 0, 4, 0], 2, 3)},
        4: {"c": ([5, 0, 0, 0, 1, 2], 8, 0)},
    }
    held |= {1: held[0], 3: held[2], 5: held[4]}
    tp_rank = {rank: rank % 2 for rank in range(6)}
    counted = [slots.pack(held[r] if counts_on_this_tp_rank(tp_rank[r], 2, False, 4, 4) else {}) for r in range(6)]
    merged = slots.unpack(_summed(counted))
    assert merged == {"a": ([3, 3, 2, 0], 8, None), "b": ([1, 1, 5, 1], 4, 4), "c": ([5, 0, 0, 0, 1, 2], 8, None)}
    # Counting the tp copies doubles every layer; a mean over ranks would not be a count at all.
    assert slots.unpack(_summed(slots.pack(held[r]) for r in range(6)))["a"][0] == [6, 6, 4, 0]
    with pytest.raises(ValueError, match="rank 1 sees router `a` as"):
        Slots.of([[a], [Slot("a", 3, 1, False)]])
    with pytest.raises(ValueError, match="3 values for 20 slots"):
        slots.unpack([1, 2, 3])


def test_under_sequence_parallelism_each_tp_rank_counts_its_share_of_the_sequence():
    # tp rank 1 of a pair: without sequence parallelism a copy; with it, a router that routed 8 of its batch's 16
    # tokens saw its share (counted), one that routed all 16 a copy (not counted); the batch unknown: a share.
    assert not counts_on_this_tp_rank(1, 2, False, routed_tokens=8, batch_tokens=16)
    assert counts_on_this_tp_rank(1, 2, True, routed_tokens=8, batch_tokens=16)
    assert not counts_on_this_tp_rank(1, 2, True, routed_tokens=16, batch_tokens=16)
    assert counts_on_this_tp_rank(1, 2, True, routed_tokens=16, batch_tokens=None)
    assert counts_on_this_tp_rank(0, 2, False, 16, 16) and counts_on_this_tp_rank(3, 1, False, 16, 16)
    # An expert-parallel layer's drops are its group's: rank 0 of the group adds them once.
    assert dropped_on_this_ep_rank(0) and not dropped_on_this_ep_rank(1) and dropped_on_this_ep_rank(None)


def test_layer_statistics_by_hand():
    layer = LayerLoad("l", (4, 3, 1, 0), top_k=2, dropped=2)  # 4 tokens x top-2 = 8 assignments, 2 of them dropped
    assert layer.total == 8 and layer.mean == 2.0
    assert layer.max_over_mean == 2.0
    assert layer.cv == pytest.approx(math.sqrt((4 + 1 + 1 + 4) / 4) / 2)
    shares = (0.5, 0.375, 0.125)
    assert layer.entropy == pytest.approx(-sum(s * math.log(s) for s in shares) / math.log(4))
    assert layer.dropped_fraction == pytest.approx(2 / 8)
    assert layer.skew == pytest.approx(1.0)  # expert 0 took every token: the most one expert can take under top-2
    even = LayerLoad("e", (10, 10, 10, 10), top_k=2)
    assert (even.max_over_mean, even.cv, even.entropy, even.skew) == (1.0, 0.0, pytest.approx(1.0), 0.0)
    assert even.dropped_fraction is None  # the layer does not say
    assert across_layers([3.0, 1.0, 2.0, 10.0]) == {"min": 1.0, "p50": 2.0, "p90": 10.0, "max": 10.0}


def test_load_per_ep_rank_the_slowest_and_the_slowdown_over_unequal_layers():
    assert ep_rank_load([5, 1, 1, 1, 2, 2, 2, 2], ep=2) == [8, 8]
    assert ep_rank_load([5, 1, 1, 1, 2, 2, 2, 2], ep=4) == [6, 2, 4, 4]
    with pytest.raises(ValueError, match="ep=3 does not divide the 8 experts"):
        ep_rank_load([1] * 8, ep=3)
    layers = [LayerLoad("a", (30, 30, 10, 10), top_k=1), LayerLoad("b", (5, 5, 5, 25), top_k=1)]
    found = verdict(layers, ep=2)  # a: ranks 60 / 20, b: 10 / 30; summed 70 / 50
    assert found.slowest_ep_rank == 0
    # Each layer waits for its busiest rank: (60 + 30) / ((80 + 40) / 2) = 1.5, not the summed ranks' 70 / 60.
    assert found.ep_slowdown == pytest.approx(1.5)
    assert verdict(layers[1:], ep=2).slowest_ep_rank == 1
    assert verdict(layers).slowest_ep_rank is None and verdict(layers).ep_slowdown is None
    record = interval(1, 4, layers, ep=2)
    assert record.tokens_per_ep_rank == (70, 50) and record.layers["b"].tokens_per_ep_rank == (10, 30)
    assert record.layers["a"].tokens == 80  # top-1
    # Only the layers whose experts ep splits (the Layout's placement) have ep ranks to wait for.
    alone = interval(1, 4, layers, ep=2, ep_layers={"b"})
    assert alone.layers["a"].tokens_per_ep_rank is None and alone.tokens_per_ep_rank == (10, 30)
    assert alone.verdict.ep_slowdown == pytest.approx(1.5) and alone.verdict.slowest_ep_rank == 1


def test_a_collapse_and_a_dead_expert_are_named_and_a_balanced_router_gets_neither():
    collapsed = LayerLoad("model.layers.0.mlp", (90, 40, 30, 40, 0, 0, 0, 0), top_k=2)  # 100 tokens
    assert collapsed.skew == pytest.approx((0.45 - 0.125) / (0.5 - 0.125))
    dead = LayerLoad("model.layers.1.mlp", (40, 40, 40, 40, 40, 0, 0, 0), top_k=2)
    balanced = LayerLoad("model.layers.2.mlp", (26, 24, 25, 25, 25, 25, 24, 26), top_k=2)
    found = verdict([collapsed, dead, balanced])
    assert [(c.layer, c.expert, c.share) for c in found.collapsed] == [("model.layers.0.mlp", 0, 0.45)]
    assert [(d.layer, d.experts) for d in found.dead] == [("model.layers.0.mlp", (4, 5, 6, 7)),
                                                          ("model.layers.1.mlp", (5, 6, 7))]
    assert not found.healthy and found.advice == advice(found)
    assert "model.moe_aux_loss_coef" in found.advice[0] and "model.moe_capacity_factor" in found.advice[1]
    hugging_face = advice(found, "hugging_face")
    assert "router_aux_loss_coef" in hugging_face[0] and "output_router_logits=True" in hugging_face[0]
    assert "no transformers config key" in hugging_face[3]
    healthy = verdict([balanced])
    assert healthy.healthy and healthy.advice == () and healthy.too_few == ()
    with pytest.raises(ValueError, match="source='megatron'"):
        advice(found, "megatron")


def test_too_few_tokens_to_call_an_expert_dead():
    sparse = LayerLoad("l", (3, 2, 1, 0), top_k=1)  # each expert due 1.5 assignments
    found = verdict([sparse])
    assert found.dead == () and found.too_few == ("l",)


def test_an_interval_survives_its_json_line():
    layers = [LayerLoad("model.layers.0.mlp.gate", (30, 30, 10, 10), top_k=2, dropped=4),
              LayerLoad("model.layers.1.mlp.gate", (40, 40, 0, 0), top_k=2)]
    record = interval(3, 4, layers, ep=2, counted="summed over 4 batch ranks")
    assert not record.verdict.healthy
    assert from_json(RoutingInterval, to_json(record, indent=None)) == record
