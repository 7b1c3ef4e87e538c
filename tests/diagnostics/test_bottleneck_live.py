"""The BottleneckMonitor on real runs, each made slow for one reason (tests/distributed/bottleneck_ranks.py):
a loader that sleeps, one rank that sleeps in forward (under dp_shard, and under pp x dp_shard in the last stage),
a pipeline with one microbatch, tp=4 over a wide model with a tiny batch, and a plain run. The class comes from the measured times (the monitor is told nothing of the setup);
what TensorBoard shows is read back with TensorBoard's own reader.

Two launches: 2 processes (plain, data, bubble: no oversubscription on this 2-core machine) and 4 processes (tp,
the stragglers, short). 8 steps each, windows of 4: the second window (steps 5-8) is the one judged.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from diagnostics.analysis.trace import find_traces, read_trace, trace_steps
from diagnostics.records import PHASES
from tests.launcher import launch

TWO = {
    "plain": {"layout": {"dp_shard": 2}, "model": {"hidden": 256, "layers": 2}, "batch_size": 32, "seq_len": 64},
    "data": {"layout": {"dp_shard": 2}, "model": {"hidden": 32}, "batch_size": 2, "seq_len": 16, "loader_sleep_s": 0.05},
    "bubble": {"layout": {"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 1}, "model": {"hidden": 256, "layers": 4},
               "batch_size": 8, "seq_len": 64},
}
FOUR = {
    "tp": {"layout": {"tp": 4}, "model": {"hidden": 512, "layers": 4, "heads": 8}, "batch_size": 1, "seq_len": 8},
    "straggler": {"layout": {"dp_shard": 4}, "model": {"hidden": 32}, "batch_size": 2, "seq_len": 16, "sleepy_rank": 2,
                  "sleep_s": 0.2},
    "short": {"layout": {"dp_shard": 2, "tp": 2}, "model": {"hidden": 32}, "batch_size": 2, "seq_len": 16,
              "sleepy_rank": 2, "sleep_s": 0.2, "every": 50},  # the defaults' window, on a run of 8 steps
    "pp_straggler": {"layout": {"pp": 2, "dp_shard": 2}, "model": {"hidden": 32, "layers": 4}, "batch_size": 4,
                     "seq_len": 16, "sleepy_rank": 3, "sleep_s": 0.1},
}
EXPECTED = {"plain": "compute-bound", "data": "data-bound", "bubble": "pipeline-bubble", "tp": "communication-bound",
            "straggler": "straggler", "pp_straggler": "straggler"}
STRAGGLERS = {"straggler": 2, "pp_straggler": 3}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    found = {}
    for world, cases in ((2, TWO), (4, FOUR)):
        out = tmp_path_factory.mktemp(f"bottleneck{world}")
        found |= launch("tests.distributed.bottleneck_ranks:monitored", world, out, timeout=400, cases=cases,
                        folder=str(out))[0]
    return found


def _judged(runs, case):
    windows = runs[case]["windows"]
    assert [(w.context.first_step, w.context.last_step) for w in windows] == [(1, 4), (5, 8)]
    return windows[-1]


@pytest.mark.parametrize("case", list(EXPECTED))
def test_each_provoked_bottleneck_is_named(runs, case):
    window = _judged(runs, case)
    diagnosis = window.diagnosis
    assert diagnosis.label == EXPECTED[case], (diagnosis.evidence, diagnosis.shares)
    assert diagnosis.advice, diagnosis
    if case in STRAGGLERS:  # under pp the slow last stage's forward, not its peers' pipeline idle time
        assert (diagnosis.rank, diagnosis.phase) == (STRAGGLERS[case], "forward"), diagnosis.evidence
        assert f"rank {STRAGGLERS[case]}" in diagnosis.advice[0]
    if case == "tp":
        assert diagnosis.dim == "tp" and "tp=4" in diagnosis.advice[0], diagnosis.advice
    if case == "bubble":
        assert "pp_microbatches=" in " ".join(diagnosis.advice) and "pp=2" in diagnosis.advice[0]
    if case == "data":
        assert "num_workers" in diagnosis.advice[0]


@pytest.mark.parametrize("case", list(EXPECTED))
def test_each_rank_window_adds_up_to_its_step(runs, case):
    window = _judged(runs, case)
    world = 4 if case in FOUR else 2
    assert [r.rank for r in window.ranks] == list(range(world))
    for r in window.ranks:
        assert r.steps == 3  # steps 5-7: step 8 is the profiled one
        total = sum(r.phases[p] for p in PHASES) + sum(r.comm.values()) + r.residual_s
        assert abs(total - r.step_s) <= 1e-9 * r.step_s
        assert abs(r.residual_s) <= 0.01 * r.step_s, r  # the live phases tile the step; the split keeps the sum
        assert min(r.phases.values()) >= 0 and min(r.comm.values(), default=0) >= 0


def test_communication_is_split_out_per_role_from_the_profiled_step(runs):
    tp = _judged(runs, "tp")
    assert all(r.comm.get("tp", 0) > 0 for r in tp.ranks)
    assert not any("fsdp" in r.comm for r in tp.ranks)  # tp=4 alone: no FSDP dim to blame
    straggler = _judged(runs, "straggler")
    waits = {r.rank: r.phases["waiting"] for r in straggler.ranks}
    assert waits[2] < min(w for rank, w in waits.items() if rank != 2)  # the others wait for rank 2


def test_throughput_counts_each_sample_once(runs):
    for case, cases in (("plain", TWO), ("tp", FOUR)):
        window, spec = _judged(runs, case), cases[case]
        dp = spec["layout"].get("dp_shard", 1)
        step_s = sum(r.step_s for r in window.ranks) / len(window.ranks)
        tokens = spec["batch_size"] * spec["seq_len"] * dp  # tp ranks see the same samples: counted once
        assert window.context.tokens_per_s == pytest.approx(tokens / step_s, rel=1e-9)
        assert 0 < window.context.mfu < 1


def test_tensorboard_shows_the_view_the_card_and_the_figure(runs):
    events = EventAccumulator(runs["straggler"]["tensorboard"], size_guidance={"tensors": 0, "scalars": 0, "images": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    for tag in ("bottleneck/step_s", "bottleneck/forward_s", "bottleneck/waiting_s", "bottleneck/comm_fsdp_s"):
        assert {f"{tag}/mean", f"{tag}/min", f"{tag}/max"} <= scalars, sorted(scalars)
    forward = {kind: events.Scalars(f"bottleneck/forward_s/{kind}")[-1].value for kind in ("min", "mean", "max")}
    assert forward["min"] < forward["mean"] < forward["max"]  # rank 2's sleep is the max
    assert [e.step for e in events.Scalars("bottleneck/step_s/mean")] == [4, 8]
    card = events.Tensors("diagnostics/bottleneck/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "**straggler**" in card and "| 2 |" in card
    image = events.Images("diagnostics/step_phases")[-1]
    assert image.width == 800 and image.height == round(100 * (1.2 + 0.35 * 4))  # add_figure's render: a row per rank
    layout = layout_pb2.Layout()
    layout.ParseFromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {chart.title: chart for category in layout.category for chart in category.chart}
    step = charts["step time (s)"].margin.series[0]
    assert (step.value, step.lower, step.upper) == ("bottleneck/step_s/mean", "bottleneck/step_s/min",
                                                    "bottleneck/step_s/max")
    assert "Troubleshooting: communication" in {category.title for category in layout.category}


def test_a_run_shorter_than_the_window_is_profiled_at_its_end_and_its_straggler_named(runs):
    """BottleneckMonitor's default window (50 steps) on an 8-step run: its one window ends with a profiled step,
    so the wait inside dp_shard x tp's collectives is told from compute and the sleeping rank is named."""
    [window] = runs["short"]["windows"]
    assert (window.context.first_step, window.context.last_step, window.context.profiled) == (1, 8, True)
    assert any(r.comm for r in window.ranks), window.ranks
    assert (window.diagnosis.label, window.diagnosis.rank, window.diagnosis.phase) == ("straggler", 2, "forward"), (
        window.diagnosis.evidence)


@pytest.mark.parametrize("case", ["straggler", "short"])
def test_every_chart_of_the_view_has_data(runs, case):
    """No empty panel ("Matches (0)"): a chart only for a role the run's communication is given to."""
    events = EventAccumulator(runs[case]["tensorboard"], size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    layout = layout_pb2.Layout()
    layout.ParseFromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    margins = {chart.title: chart.margin.series[0].value for category in layout.category for chart in category.chart
               if chart.HasField("margin")}
    assert {title: tag for title, tag in margins.items() if tag not in scalars} == {}
    assert {"hsdp (s)", "batch (s)", "dp_shard (s)"}.isdisjoint(margins) and "fsdp (s)" in margins


def test_the_last_profiled_step_is_left_for_the_trace_cli(runs):
    """Windows are analysed from the profiler in memory; each rank's last profiled step is written at the fit's end,
    and reads as `python -m diagnostics trace` reads it: one step, its tp communication split out."""
    traces = find_traces(Path(runs["tp"]["tensorboard"]) / "diagnostics" / "traces")
    assert sorted(traces) == [0, 1, 2, 3]
    for rank, paths in traces.items():
        steps = trace_steps(read_trace(paths[0]))
        assert len(steps) == 1, rank
        assert sum(parts.get("comm:tp", 0.0) for parts in steps[0].split.values()) > 0, (rank, steps[0].split)
