"""The strategy's typed events, heard by an ordinary Trainer callback in real 4-rank runs (events_ranks.py)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.launcher import launch

WORLD = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("events")
    return launch("tests.distributed.events_ranks:run_all", WORLD, out / "logs", timeout=600, folder=str(out))


def _events(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["event"] == kind]


def test_process_group_events_come_in_order_with_the_layouts_groups(runs):
    for rank in range(WORLD):
        events = _events(runs[rank]["pp_cp"]["events"])
        kinds = [e["event"] for e in events]
        assert kinds[:3] == ["BeforeProcessGroup", "ProcessGroupsCreated", "LayoutReady"], kinds[:5]
        before = events[0]
        assert before["rank"] == rank and before["world_size"] == WORLD and before["backend"] == "gloo"
        groups = {g["role"]: g for g in events[1]["groups"]}
        roles = events[2]["roles"]
        for role in ("pp", "cp", "batch", "loss"):
            mine = next(group for group in roles[role] if rank in group)
            assert groups[role]["ranks"] == mine and groups[role]["desc"] == f"mesh_{role}", role
        assert groups["world"]["ranks"] == list(range(WORLD))
        assert events[2]["techniques"] == ["pipeline_split", "context_parallel", "fsdp"]


def test_phases_timings_and_point_to_point_under_pp_and_cp(runs):
    for rank in range(WORLD):
        events = _events(runs[rank]["pp_cp"]["events"])
        phases = Counter((e["step"], e["phase"]) for e in _of(events, "StepPhase"))
        for step in (0, 1):
            assert phases[(step, "forward")] == 4 and phases[(step, "backward")] == 4  # 4 microbatches
            assert phases[(step, "optimizer")] == 1
        assert phases[(1, "data_wait")] == 1
        timings = _of(events, "StageTiming")
        assert len(timings) == 2 and all(t["step_s"] >= t["compute_s"] > 0 for t in timings)
        p2p = _of(events, "PointToPoint")
        pp_peer = rank ^ 2  # pp is the outer dim: ranks r and r+2 hold the two stages
        cp_peer = rank ^ 1
        pipeline = [e for e in p2p if e["role"] == "pp"]
        ring = [e for e in p2p if e["role"] == "cp"]
        assert {e["peer"] for e in pipeline} == {pp_peer} and {e["peer"] for e in ring} == {cp_peer}
        for ops in (pipeline, ring):
            states = Counter(e["state"] for e in ops)
            assert states["issued"] == states["completed"] > 0 and all(e["bytes"] > 0 for e in ops)
        # Forward: stage 0 sends activations, stage 1 receives them; backward the gradients come back.
        sent = Counter(e["op"] for e in pipeline if e["state"] == "issued")
        assert sent["send"] == sent["recv"] == 2 * 4  # per step: 4 microbatches one way, 4 gradients back
        assert _of(events, "CollectiveWait")
        saved = _of(events, "CheckpointSaved")
        assert [e["step"] for e in saved] == [1, 2] and all(Path(e["path"]).is_dir() for e in saved)


def test_checkpoint_loaded_under_another_layout(runs):
    for rank in range(WORLD):
        events = _events(runs[rank]["resumed"]["events"])
        loaded = _of(events, "CheckpointLoaded")
        assert len(loaded) == 1 and loaded[0]["resharded"] is True and loaded[0]["path"].endswith("step=2.ckpt")
        assert len(runs[rank]["resumed"]["losses"]) == 1  # steps 2 -> 3


def test_the_phases_of_an_expert_parallel_step_follow_each_other(runs):
    for rank in range(WORLD):
        phases = {(e["step"], e["phase"]): e for e in _of(_events(runs[rank]["moe"]["events"]), "StepPhase")}
        for step in (0, 1):  # the phases follow each other: Lightning's optimizer step wraps forward and backward
            forward, backward, optimizer = (phases[(step, name)] for name in ("forward", "backward", "optimizer"))
            assert forward["start_s"] + forward["duration_s"] <= backward["start_s"]
            assert backward["start_s"] + backward["duration_s"] <= optimizer["start_s"]


def test_the_short_timeout_waits_for_a_slow_first_step(runs):
    """Rank 1 spends 5 s more in its first step than the others, with a 2 s step timeout: every rank
    switches to it only once all are past the first step, so the run finishes."""
    for rank in range(WORLD):
        assert len(runs[rank]["slow_first_step"]["losses"]) == 3


def test_out_of_memory_and_the_verdict_reach_listeners_before_fit_raises(runs):
    for rank in range(WORLD):
        result = runs[rank]["oom"]
        assert "out of memory" in result["raised"]
        events = _events(result["events"])
        oom, verdict = _of(events, "OutOfMemory"), _of(events, "FailureVerdict")
        assert len(oom) == 1 and oom[0]["rank"] == rank and oom[0]["stage"] == "train"
        assert "Tried to allocate 2.00 GiB" in oom[0]["message"]
        assert len(verdict) == 1 and verdict[0]["culprit"] == rank and verdict[0]["thread"] == "MainThread"
        assert [e["event"] for e in events].index("OutOfMemory") < [e["event"] for e in events].index("FailureVerdict")
