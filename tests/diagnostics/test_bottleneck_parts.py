"""The BottleneckMonitor's parts without a run: the step clock, the sampled split, the card and figure, the view's
layout, the offline ``trace`` command over the recorded traces, and the arguments' checks."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from diagnostics.analysis.sampled_split import split_window
from diagnostics.collect.step_clock import StepClock, mean_row
from diagnostics.records import PHASES, Diagnosis, RankTimes, WindowContext, WindowRecord, read_windows, to_json
from diagnostics.report.bottleneck_card import COLOURS, bottleneck_markdown, step_phase_figure

TRACES = Path(__file__).parents[1] / "data" / "traces"


def _phase(name, start, duration):
    return SimpleNamespace(phase=name, start_s=start, duration_s=duration)


def test_the_clock_tiles_each_step_and_clips_a_phase_begun_before_it():
    clock = StepClock()
    clock.begin(10.0)
    clock.phase(_phase("data_wait", 9.5, 0.7))  # began in the previous step's hooks: only 0.2 s is this step's
    clock.phase(_phase("forward", 10.2, 0.3))
    clock.phase(_phase("backward", 10.5, 0.25))
    clock.phase(_phase("backward_weight", 10.75, 0.05))
    clock.stage(SimpleNamespace(idle_s=0.1))
    clock.exclude(11.0, 11.5)  # a validation loop inside the step
    row = clock.close(12.2)
    assert row == pytest.approx({"data_wait": 0.2, "forward": 0.3, "backward": 0.3, "optimizer": 0.0,
                                 "pipeline_idle": 0.1, "host": 0.8, "step_s": 1.7})
    assert clock.close(12.5)["step_s"] == pytest.approx(0.3)  # the next step began at the close
    assert mean_row(clock.take()) == pytest.approx({**{k: v / 2 for k, v in row.items() if k != "step_s"},
                                                    "host": (0.8 + 0.3) / 2, "step_s": 1.0})
    assert clock.take() == []


def test_the_clock_takes_nested_phases_and_excluded_time_out_of_the_outer_phase():
    clock = StepClock()
    clock.begin(0.0)
    clock.phase(_phase("data_wait", 0.0, 0.9))  # spans a checkpoint save (0.2-0.6)
    clock.exclude(0.2, 0.6)
    clock.phase(_phase("backward", 1.1, 0.2))  # manual optimization: backward and optimizer inside forward
    clock.phase(_phase("optimizer", 1.3, 0.2))
    clock.phase(_phase("forward", 1.0, 0.6))
    row = clock.close(2.0)
    assert row == pytest.approx({"data_wait": 0.5, "forward": 0.2, "backward": 0.2, "optimizer": 0.2,
                                 "pipeline_idle": 0.0, "host": 0.5, "step_s": 1.6})


def test_the_split_keeps_the_live_magnitudes_and_takes_the_trace_proportions():
    live = {"step_s": 1.0, "data_wait": 0.25, "host": 0.05, "forward": 0.4, "backward": 0.2, "optimizer": 0.1,
            "pipeline_idle": 0.0}
    trace = SimpleNamespace(split={
        "data_wait": {"loader": 0.2, "host": 0.1, "comm:loss": 0.0},
        "forward": {"compute": 0.3, "comm:tp": 0.1},  # a quarter of forward is tp
        "backward": {"compute": 0.1, "comm:tp": 0.05, "comm:fsdp": 0.05},
    })
    times = split_window(3, 5, live, trace)
    assert times.rank == 3 and times.steps == 5
    assert times.phases["data_wait"] == pytest.approx(0.3 * 2 / 3) and times.phases["host"] == pytest.approx(0.1)
    assert times.phases["forward"] == pytest.approx(0.3) and times.comm["tp"] == pytest.approx(0.1 + 0.05)
    assert times.phases["backward"] == pytest.approx(0.1) and times.comm["fsdp"] == pytest.approx(0.05)
    assert times.phases["optimizer"] == pytest.approx(0.1)  # not in the trace: the live figure stands
    assert times.residual_s == pytest.approx(0.0, abs=1e-12)
    unprofiled = split_window(0, 5, live, None)
    assert unprofiled.comm == {} and unprofiled.phases["forward"] == 0.4 and unprofiled.phases["waiting"] == 0.0


def _record(label="straggler"):
    ranks = tuple(RankTimes(rank=r, steps=3, step_s=1.0, phases={**dict.fromkeys(PHASES, 0.1), "forward": 0.2 + r * 0.1},
                            comm={"tp": 0.1}, residual_s=1.0 - 0.8 - r * 0.1) for r in range(3))
    context = WindowContext(first_step=5, last_step=8, dims={"tp": 3}, tokens_per_s=1234.5, mfu=0.25)
    return WindowRecord(context=context, ranks=ranks, diagnosis=Diagnosis(
        label=label, shares={}, evidence="rank 2 is slow.", advice=("look at rank 2",), rank=2, phase="forward"))


def test_the_card_the_figure_and_the_jsonl_line():
    record = _record()
    card = bottleneck_markdown(record, profiled=True)
    assert "Steps 5-8: **straggler** (rank 2, forward)" in card and "- look at rank 2" in card
    assert "1,234 tokens/s" in card or "1,235 tokens/s" in card
    assert "| 2 | 1000.0 |" in card and "comm tp" in card
    figure = step_phase_figure(record.ranks)
    [axes] = figure.axes
    assert [tick.get_text() for tick in axes.get_yticklabels()] == [f"rank {r.rank}" for r in record.ranks]
    assert axes.get_xlabel() == "ms per step (mean over the window)"
    present = [p for p in PHASES if any(r.phases.get(p, 0.0) > 0 for r in record.ranks)]
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert legend == [{"data_wait": "data wait", "pipeline_idle": "pipeline idle"}.get(p, p) for p in present] + [
        f"comm {role}" for role in sorted({role for r in record.ranks for role, s in r.comm.items() if s > 0})]
    forward = [bar for bar in axes.patches if tuple(round(c * 255) for c in bar.get_facecolor()[:3]) == COLOURS["forward"]]
    assert [round(bar.get_width(), 6) for bar in forward] == [round(r.phases["forward"] * 1e3, 6) for r in record.ranks]
    figure.canvas.draw()  # renders headless (Agg): 8 inches at 100 dpi, a row per rank
    width, height = figure.canvas.get_width_height()
    assert width == 800 and height == round(100 * (1.2 + 0.35 * len(record.ranks)))
    again = read_windows(to_json(record, indent=None) + "\n" + '{"cut short')
    assert again == [record]


def test_the_view_owns_one_layout_with_margin_charts():
    from diagnostics import TroubleshootingView

    view = TroubleshootingView()
    view.margin("step", "step time (s)", "bottleneck/step_s")
    view.multiline("memory", "per rank", [r"memory/.*_bytes/rank\d+"])
    assert view.layout() == {
        "Troubleshooting: memory": {"per rank": ["Multiline", [r"memory/.*_bytes/rank\d+"]]},
        "Troubleshooting: step": {"step time (s)": ["Margin", ["bottleneck/step_s/mean", "bottleneck/step_s/min",
                                                                "bottleneck/step_s/max"]]}}
    trainer = SimpleNamespace(callbacks=[object(), view])
    assert TroubleshootingView.of(trainer) is view and TroubleshootingView.of(SimpleNamespace(callbacks=[])) is None


def test_bad_arguments_are_refused_with_the_fix():
    from diagnostics import BottleneckMonitor, all_monitors

    with pytest.raises(ValueError, match="every_n_steps=1.*>= 2"):
        BottleneckMonitor(every_n_steps=1)
    assert BottleneckMonitor(every_n_steps=1, profile=False).every == 1
    with pytest.raises(ValueError, match="Unknown hardware"):
        BottleneckMonitor(hardware="h1000")
    with pytest.raises(TypeError, match="True, False or a dict"):
        all_monitors(memory="yes")
    names = [type(m).__name__ for m in all_monitors(memory=False, bottleneck={"every_n_steps": 5})]
    assert names == ["TroubleshootingView", "LayoutCard", "BottleneckMonitor", "CollectiveMonitor", "RoutingMonitor",
                     "RunSummary"]


def test_the_trace_command_classifies_recorded_traces(capsys):
    from diagnostics.__main__ import main

    assert main(["trace", str(TRACES / "fsdp4_straggler"), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["diagnosis"]["label"] == "straggler" and record["diagnosis"]["rank"] == 3
    assert record["diagnosis"]["phase"] == "forward"
    assert main(["trace", str(TRACES / "pp2_gpipe")]) == 0
    assert "pipeline-bubble" in capsys.readouterr().out
    assert main(["trace", str(TRACES / "fsdp4_slow_loader")]) == 0
    assert "data-bound" in capsys.readouterr().out


def test_the_trace_command_says_what_it_looked_for(tmp_path, capsys):
    from diagnostics.__main__ import main

    assert main(["trace", str(tmp_path / "missing")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert main(["trace", str(tmp_path)]) == 2
    assert "no torch.profiler trace" in capsys.readouterr().err


def test_a_new_fit_starts_its_windows_afresh_and_a_later_validate_keeps_them(tmp_path):
    from diagnostics import BottleneckMonitor

    windows = tmp_path / "diagnostics" / "bottleneck.jsonl"
    windows.parent.mkdir()
    windows.write_text("{}\n")
    monitor, trainer = BottleneckMonitor(), SimpleNamespace(default_root_dir=str(tmp_path), global_rank=0)
    monitor.setup(trainer, None, "validate")
    assert windows.exists()
    monitor.setup(SimpleNamespace(default_root_dir=str(tmp_path), global_rank=1), None, "fit")
    assert windows.exists()  # rank 0's to remove
    monitor.setup(trainer, None, "fit")
    assert not windows.exists()


PROFILED = """
import os, torch
from diagnostics.collect.profiler_notes import without_profiler_notes
profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
with {quiet}:
    profiler.__enter__()
    os.write(2, b"a line of the run's own\\n")
torch.ones(3).sum()
with {quiet}:
    profiler.__exit__(None, None, None)
"""


@pytest.mark.parametrize("quiet", [True, False])
def test_the_profilers_start_and_stop_notes_are_dropped_and_nothing_else(quiet):
    import subprocess
    import sys

    code = PROFILED.format(quiet="without_profiler_notes()" if quiet else "open(os.devnull)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert "a line of the run's own" in done.stderr
    assert ("profiler_start" in done.stderr and "profiler_stop" in done.stderr) is not quiet, done.stderr
