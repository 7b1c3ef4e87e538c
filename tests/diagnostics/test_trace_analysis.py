"""Profiler traces -> each step's parts (`diagnostics/analysis/trace.py`) on the recorded CPU traces in
tests/data/traces (4 gloo ranks of a tiny Llama, one folder per layout, recorded by
``tests/distributed/bottleneck_ranks.py:record_traces``), checked against figures computed here from the raw
events; a plain trace without our labels; reading and finding trace files; and gloo's work spans on a synthetic
trace. The synthetic NCCL GPU traces are in test_trace_gpu.py."""

from __future__ import annotations

import copy
import functools
import gzip
import json
import shutil
import time
from pathlib import Path
from statistics import median

import pytest

from diagnostics.analysis.trace import (
    TraceStep,
    dims_from_trace,
    find_traces,
    rank_times,
    read_trace,
    trace_rank,
    trace_steps,
)
from diagnostics.records import PHASES
from tests.diagnostics.trace_cases import op

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
CASES = ("fsdp2_tp2", "hsdp", "pp2_gpipe", "cp2_fsdp2", "ep2", "fsdp4_straggler", "fsdp4_slow_loader")
RANKS = range(4)


@functools.lru_cache(maxsize=None)
def _trace(case: str, rank: int) -> dict:
    return read_trace(TRACES / case / f"rank{rank}.json.gz")


@functools.lru_cache(maxsize=None)
def _steps(case: str, rank: int) -> tuple[TraceStep, ...]:
    return tuple(trace_steps(_trace(case, rank)))


def _times(case: str, rank: int):
    return rank_times(_steps(case, rank), rank)


def _us(seconds: float):
    """Equal to a microsecond, the trace's resolution (its timestamps are microseconds since boot, as floats)."""
    return pytest.approx(seconds, rel=1e-6, abs=1e-6)


def _parts(step: TraceStep, part: str) -> float:
    return sum(parts.get(part, 0.0) for parts in step.split.values())


# ---- independent figures from the raw events: interval arithmetic on the main thread -------------------------

def _main(trace: dict) -> list[dict]:
    steps = [e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
    tid = steps[0]["tid"]
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("tid") == tid
            and e.get("cat") in ("cpu_op", "user_annotation")]


def _union(events, predicate) -> list[tuple[float, float]]:
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if predicate(str(e["name"])))
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def _minus(spans, holes) -> list[tuple[float, float]]:
    out = []
    for a, b in spans:
        pieces = [(a, b)]
        for ha, hb in holes:
            pieces = [p for x, y in pieces for p in ((x, min(y, ha)), (max(x, hb), y)) if p[1] > p[0]]
        out.extend(pieces)
    return out


def _is_comm(name: str) -> bool:
    return name.startswith(("c10d::", "_c10d_functional::", "FSDP::", "nd::comm::")) or "c10d_functional" in name


# ---- the recorded traces ------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_every_step_is_tiled_by_its_parts_and_lasts_its_profiler_step(case):
    for rank in RANKS:
        raw = {int(e["name"].split("#")[1]): e["dur"] / 1e6 for e in _main(_trace(case, rank))
               if e["name"].startswith("ProfilerStep#")}
        steps = _steps(case, rank)
        assert [s.step for s in steps] == sorted(raw)
        for step in steps:
            total = sum(s for parts in step.split.values() for s in parts.values())
            assert total == pytest.approx(step.step_s, rel=1e-6)
            assert step.step_s == pytest.approx(raw[step.step], rel=1e-6)
            assert set(step.split) <= {"forward", "backward", "optimizer", "pipeline", "data_wait"}
        times = _times(case, rank)
        assert set(times.phases) == set(PHASES) and times.phases["waiting"] == 0.0
        assert abs(times.residual_s) < 1e-9 * times.step_s


def test_fsdp2_tp2_two_steps_with_tp_and_fsdp_measured_from_the_raw_events():
    assert [s.step for s in _steps("fsdp2_tp2", 0)] == [3, 4]
    for rank in RANKS:
        events = _main(_trace("fsdp2_tp2", rank))
        labels = _union(events, lambda n: n.startswith(("FSDP::", "nd::comm::")))
        fsdp = _length(_union(events, lambda n: n.startswith("FSDP::")))
        tp = _length(_minus(_union(events, lambda n: "c10d_functional" in n), labels))
        steps = _steps("fsdp2_tp2", rank)
        assert sum(_parts(s, "comm:fsdp") for s in steps) == _us(fsdp / 1e6)
        assert sum(_parts(s, "comm:tp") for s in steps) == _us(tp / 1e6)
        assert tp > 1000 and fsdp > 1000  # over a millisecond each


def test_tp_is_named_only_because_the_run_has_tp():
    trace = _trace("fsdp2_tp2", 0)
    dims = dims_from_trace(trace)
    with_tp, without = rank_times(trace_steps(trace, dims), 0), rank_times(trace_steps(trace, {**dims, "tp": 1}), 0)
    assert "tp" not in without.comm
    assert without.comm["other"] == pytest.approx(with_tp.comm["other"] + with_tp.comm["tp"], rel=1e-9)


def test_hsdp_splits_the_replica_all_reduce_from_fsdp():
    for rank in RANKS:
        times = _times("hsdp", rank)
        assert times.comm["dp_replicate"] > 0 and times.comm["fsdp"] > times.comm["dp_replicate"]
        events = _main(_trace("hsdp", rank))
        fsdp = _union(events, lambda n: n.startswith("FSDP::"))
        replica = [e["dur"] for e in events if e["name"] == "c10d::allreduce_"
                   and any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in fsdp)]
        assert times.comm["dp_replicate"] == _us(sum(replica) / 1e6)
    flat = rank_times(trace_steps(_trace("hsdp", 0), {**dims_from_trace(_trace("hsdp", 0)), "dp_replicate": 1}), 0)
    assert "dp_replicate" not in flat.comm


@pytest.mark.parametrize(("case", "role"), [("cp2_fsdp2", "cp"), ("ep2", "ep")])
def test_our_labels_name_cp_and_ep_and_the_kind_names_the_unlabelled_all_to_all(case, role):
    for rank in RANKS:
        events = _main(_trace(case, rank))
        # ep: also backward's all-to-all (the autograd node of the functional collective, and its wait)
        spans = _union(events, lambda n: n.startswith(f"nd::comm::{role}::")
                       or (role == "ep" and ("all_to_all" in n or "alltoall" in n)))
        expected = _length(_minus(spans, _union(events, lambda n: n.startswith("FSDP::"))))
        assert expected > 100 and _times(case, rank).comm[role] == _us(expected / 1e6)


def test_pipeline_idle_is_the_schedules_time_outside_microbatches_and_other_communication():
    for rank in RANKS:
        events = _main(_trace("pp2_gpipe", rank))
        busy = _union(events, lambda n: (n.startswith("nd::phase::") and n != "nd::phase::optimizer")
                      or (_is_comm(n) and "send" not in n and "recv" not in n))
        idle = _length(_minus(_union(events, lambda n: n == "nd::pipeline"), busy))
        times = _times("pp2_gpipe", rank)
        assert times.phases["pipeline_idle"] == _us(idle / 1e6)
        assert times.phases["pipeline_idle"] > 0.08 * times.step_s
    shares = [_times("pp2_gpipe", rank).phases["pipeline_idle"] / _times("pp2_gpipe", rank).step_s for rank in RANKS]
    assert sum(shares) / len(shares) > 0.15  # one microbatch: a big bubble


def test_slow_loader_waits_two_samples_and_the_others_far_less():
    for rank in RANKS:
        loader = _length(_union(_main(_trace("fsdp4_slow_loader", rank)), lambda n: n.startswith("enumerate(")))
        waited = _times("fsdp4_slow_loader", rank).phases["data_wait"]
        assert waited == _us(loader / 1e6)
        assert waited >= 0.035  # 2 samples, each sleeping >= 20 ms (record_traces's loader_sleep_s)
    others = [_times(case, rank).phases["data_wait"] for case in CASES if case != "fsdp4_slow_loader"
              for rank in RANKS]
    assert max(others) < 0.5 * min(_times("fsdp4_slow_loader", rank).phases["data_wait"] for rank in RANKS)


def test_the_straggler_computes_longer_in_forward_and_the_others_wait_for_it_in_fsdp():
    ranks = [_times("fsdp4_straggler", rank) for rank in RANKS]
    assert ranks[3].phases["forward"] - median(r.phases["forward"] for r in ranks[:3]) >= 0.040
    assert min(r.comm["fsdp"] for r in ranks[:3]) > ranks[3].comm["fsdp"]


@pytest.mark.parametrize("case", CASES)
def test_dims_from_the_process_groups_match_the_layout(case):
    layout = json.loads((TRACES / case / "layout.json").read_text())["dims"]
    for rank in RANKS:
        assert dims_from_trace(_trace(case, rank)) == {k: v for k, v in layout.items() if k != "world_size"}
        assert trace_rank(_trace(case, rank)) == rank


def test_a_plain_trace_falls_back_on_torchs_labels():
    for case in ("fsdp2_tp2", "hsdp", "fsdp4_straggler"):
        labelled = _times(case, 0)
        plain = copy.copy(_trace(case, 0))
        plain["traceEvents"] = [e for e in plain["traceEvents"] if not str(e.get("name", "")).startswith("nd::")]
        times = rank_times(trace_steps(plain), 0)
        assert times.phases["forward"] >= 0.9 * labelled.phases["forward"] > 0
        for phase in ("backward", "optimizer"):
            assert times.phases[phase] == pytest.approx(labelled.phases[phase], rel=0.25)
        for role in ("fsdp", "tp", "dp_replicate"):
            assert times.comm.get(role, 0.0) == _us(labelled.comm.get(role, 0.0))  # no label of ours names them
        assert times.step_s == _us(labelled.step_s)


def test_a_trace_without_profiler_steps_is_one_step():
    trace = copy.copy(_trace("hsdp", 0))
    trace["traceEvents"] = [e for e in trace["traceEvents"] if not str(e.get("name", "")).startswith("ProfilerStep")]
    (step,) = trace_steps(trace)
    events = [e for e in _main(_trace("hsdp", 0)) if not e["name"].startswith("ProfilerStep")]
    assert step.step is None
    assert step.step_s == _us((max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e6)
    assert _parts(step, "comm:dp_replicate") == _us(_times("hsdp", 0).comm["dp_replicate"])


def test_one_rank_trace_is_analysed_fast():
    trace = _trace("fsdp2_tp2", 0)  # the largest: ~10k events, 2 steps
    start = time.process_time()
    trace_steps(trace)
    assert time.process_time() - start < 0.5  # ~30 ms; a quadratic search would take seconds


# ---- files --------------------------------------------------------------------------------------------------

def test_read_trace_names_the_file_that_is_not_a_trace(tmp_path):
    (tmp_path / "notes.json").write_text("not json")
    (tmp_path / "layout.json").write_text('{"dims": {}}')
    (tmp_path / "broken.json.gz").write_bytes(b"\x1f\x8b garbage")
    for name in ("notes.json", "layout.json", "broken.json.gz"):
        with pytest.raises(ValueError, match=rf"{name}.*HINT: export"):
            read_trace(tmp_path / name)
    plain = tmp_path / "rank1.json"
    plain.write_text(json.dumps(_trace("hsdp", 1)))
    assert read_trace(plain)["distributedInfo"]["rank"] == 1


def test_find_traces_by_the_rank_inside(tmp_path):
    for rank in RANKS:  # torch's tensorboard_trace_handler names, no rank in them
        folder = tmp_path / ("nested" if rank % 2 else "")
        folder.mkdir(exist_ok=True)
        shutil.copy(TRACES / "hsdp" / f"rank{rank}.json.gz", folder / f"vm_{100 + 3 * rank}.17000.pt.trace.json.gz")
    shutil.copy(TRACES / "hsdp" / "layout.json", tmp_path / "layout.json")
    found = find_traces(tmp_path)
    assert sorted(found) == list(RANKS)
    assert all(trace_rank(read_trace(paths[0])) == rank and len(paths) == 1 for rank, paths in found.items())
    lonely = tmp_path / "single"
    lonely.mkdir()
    trace = {key: value for key, value in _trace("hsdp", 2).items() if key != "distributedInfo"}
    with gzip.open(lonely / "trace.json.gz", "wt") as out:
        json.dump(trace, out)
    assert find_traces(lonely) == {0: [lonely / "trace.json.gz"]}
    shutil.copy(lonely / "trace.json.gz", lonely / "other.json.gz")
    with pytest.raises(ValueError, match="Which rank wrote"):
        find_traces(lonely)
    only_json = tmp_path / "no_trace"
    only_json.mkdir()
    shutil.copy(TRACES / "hsdp" / "layout.json", only_json / "layout.json")
    with pytest.raises(ValueError, match="No torch.profiler trace"):
        find_traces(only_json)


# ---- a synthetic trace (Kineto's format) -------------------------------------------------------------------

def test_gloos_work_spans_are_left_out_they_do_not_nest():
    # gloo records a send / recv from issue to completion on the main thread: here the recv completes
    # after the op returned, across a label of ours, which would otherwise be cut short as its child
    events = [op("ProfilerStep#2", 0, 100, cat="user_annotation"),
              op("nd::phase::forward", 0, 100, cat="user_annotation"),
              op("c10d::recv_", 10, 2), op("gloo:recv", 12.5, 47.5, cat="user_annotation"),
              op("nd::comm::cp::ring_wait", 50, 20, cat="user_annotation")]
    (step,) = trace_steps({"traceEvents": events}, {"cp": 2})
    assert step.split == {"forward": pytest.approx({"comm:cp": 22e-6, "compute": 78e-6})}
