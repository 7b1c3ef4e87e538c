"""The `RoutingMonitor` on 4 processes (tests/distributed/routing_ranks.py): the tokens per expert it writes to
``routing.jsonl`` equal, interval by interval, expert by expert and layer by layer, what one process's routers chose
on the same batches, for routers the test skewed: the reference MoE under dp_shard=4 x ep=2 (with accumulation
steps and checkpointed blocks), pp=2 x dp_shard=2 x ep=2 (microbatches), ep=2 x tp=2 (with a capacity limit: the
dropped assignments too) and cp=2 x dp_shard=2; Mixtral and Qwen3-MoE under the first three; DeepSeek-V3 (a dense
first layer) under pp=2 x dp_shard=2, whose first stage holds no router and still joins every interval's reduction.
The reference MoE's loss-free bias, moved by the strategy after each step, ends as one process's. A resumed fit
appends to the file, which then adds up to the whole run. A provoked collapse and a provoked dead
expert are named, a balanced router gets neither, and TensorBoard's reader finds the histograms, the heatmap, the
scalars, the card and the view's charts."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.util.tensor_util import make_ndarray

from diagnostics.records import RoutingInterval, read_intervals
from tests.distributed.routing_ranks import CAPACITY, CASES, EVERY, STEPS
from tests.launcher import launch


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("routing")
    return launch("tests.distributed.routing_ranks:run_all", 4, folder, timeout=600, folder=str(folder))[0]


def _expected(reference: dict, first: int, last: int) -> dict[str, list[int]]:
    """Each layer's counts summed over optimizer steps ``first`` to ``last`` (1-based, both included)."""
    return {layer: [sum(step[e] for step in steps[first - 1:last]) for e in range(len(steps[0]))]
            for layer, steps in reference["counts"].items()}


def _check_against_reference(intervals: list[RoutingInterval], reference: dict, bounds: list[tuple[int, int]]) -> None:
    assert [(r.first_step, r.step) for r in intervals] == bounds
    for record in intervals:
        expected = _expected(reference, record.first_step, record.step)
        got = {layer: list(routing.tokens_per_expert) for layer, routing in record.layers.items()}
        assert got == expected, f"steps {record.first_step}-{record.step}"
        for layer, routing in record.layers.items():
            assert sum(routing.tokens_per_expert) == routing.tokens * routing.top_k


@pytest.mark.parametrize("name, layout", CASES)
def test_counts_equal_one_process_interval_by_interval(results, name, layout):
    result = results[(name, layout)]
    intervals = read_intervals("\n".join(result["lines"]))
    assert len(intervals) == len(result["lines"]) == 3
    reference = result["reference"]
    # Intervals of EVERY optimizer steps, and the last, partial one written when fit ended.
    _check_against_reference(intervals, reference, [(1, EVERY), (EVERY + 1, 2 * EVERY), (STEPS, STEPS)])
    loads = [count for step in reference["counts"].values() for counts in step for count in counts]
    assert max(loads) > 3 * min(loads) + 1, "the test's skew makes the loads uneven"
    for record in intervals:
        for layer, routing in record.layers.items():
            if (name, layout) in CAPACITY:  # the dropped assignments, as one process drops them
                dropped = reference["dropped"][layer][record.first_step - 1:record.step]
                assert routing.dropped == sum(dropped) and sum(dropped) > 0
            elif name != "moe_llama":
                assert routing.dropped is None  # transformers' routers do not say: not a 0
            if record.ep > 1:
                assert sum(routing.tokens_per_ep_rank or ()) == sum(routing.tokens_per_expert)
    if name == "moe_llama":  # the loss-free bias moved after every step as one process moves it
        assert result["biases"] and any(any(b) for b in result["biases"].values())
        assert result["biases"] == {n: b for n, b in reference["biases"].items() if n in result["biases"]}


def test_a_resumed_fit_appends_and_the_file_adds_up_to_the_whole_run(results):
    result = results["resumed"]
    intervals = read_intervals("\n".join(result["lines"]))
    # First fit: an interval at step 2, one ending at the checkpoint (step 3); the resumed fit: step 4, then 5.
    _check_against_reference(intervals, result["reference"], [(1, 2), (3, 3), (4, 4), (5, 5)])


def test_collapse_and_dead_expert_named_balanced_router_neither(results):
    (record,) = read_intervals("\n".join(results["verdicts"]["lines"]))
    found = record.verdict
    layers = [f"model.layers.{i}.mlp.gate" for i in range(3)]
    assert [(c.layer, c.expert) for c in found.collapsed] == [(layers[0], 0)]
    assert found.collapsed[0].share == pytest.approx(0.5)  # top-2: every token's first choice
    dead = {d.layer: d.experts for d in found.dead}
    assert dead == {layers[0]: (2, 3, 4, 5, 6, 7), layers[1]: (5,)}
    balanced = record.layers[layers[2]]
    assert balanced.max_over_mean < 1.3 and balanced.entropy > 0.95
    assert found.advice and "model.moe_aux_loss_coef" in found.advice[0]
    assert found.slowest_ep_rank == 0 and found.ep_slowdown > 1.3  # experts 0 and 1 live on ep rank 0


def test_tensorboard_holds_the_histograms_the_heatmap_the_scalars_and_the_view(results):
    events = EventAccumulator(results["verdicts"]["folder"], size_guidance={"scalars": 0, "tensors": 0,
                                                                            "histograms": 0, "images": 0})
    events.Reload()
    tags = events.Tags()
    layers = [f"model.layers.{i}.mlp.gate" for i in range(3)]
    for index, layer in enumerate(layers):
        (histogram,) = events.Histograms(f"routing/{layer}")
        counts = [int(c) for c in histogram.histogram_value.bucket]
        (record,) = read_intervals("\n".join(results["verdicts"]["lines"]))
        assert counts == list(record.layers[layer].tokens_per_expert) and histogram.step == 4
    (heatmap,) = events.Images("diagnostics/routing_heatmap")
    assert heatmap.encoded_image_string.startswith(b"\x89PNG") and heatmap.width > 200
    assert events.Scalars("routing/max_over_mean/max")[0].value == pytest.approx(4.0)  # layer 0: 50% of 8 experts
    assert {"routing/cv/p50", "routing/entropy/min", "routing/ep_slowdown", "routing/dropped_fraction/max"} <= set(
        tags["scalars"])
    card = make_ndarray(events.Tensors("diagnostics/routing/text_summary")[0].tensor_proto)[0].decode()
    assert "**Collapse** in `model.layers.0.mlp.gate`" in card
    assert "**Dead experts** in `model.layers.1.mlp.gate`" in card
    view = layout_pb2.Layout()
    view.ParseFromString(make_ndarray(events.Tensors("custom_scalars__config__")[0].tensor_proto).item())
    charts = {chart.title: list(chart.multiline.tag) for c in view.category if c.title == "Troubleshooting: routing"
              for chart in c.chart}
    assert charts["busiest expert's load over the mean, across layers"] == ["routing/max_over_mean/.*"]
    assert "expert compute under ep over a balanced load" in charts
