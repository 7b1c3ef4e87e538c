"""Real faults in real 4-rank runs with `CollectiveMonitor` on (`tests/distributed/hang_ranks.py`): every rank
exits non-zero within ``timeout`` + 30 s with the default 60 s heartbeat, ``hang.json`` names the rank, the mesh
dim and the op (for a stuck rank, its line), and rank 0's ``run.json`` (`RunSummary`: a sweep's row) says hang or
crash with the culprit. ``TORCH_DISTRIBUTED_DEBUG`` is off in every run (removed from the
ranks' environment): no fault is turned into an early desync error by it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.distributed.hang_ranks import TIMEOUT_S
from tests.launcher import exits, start

WORLD = 4
SCENARIO = Path(__file__).resolve().parents[1] / "distributed" / "hang_ranks.py"
ENVIRONMENT = {"PYTHONFAULTHANDLER": None, "TORCH_DISTRIBUTED_DEBUG": None}


def _line(text: str) -> int:
    """The scenario's line that holds ``text`` (so the expected frames follow the file)."""
    return next(i for i, line in enumerate(SCENARIO.read_text().splitlines(), 1) if text in line)


def _run(root: Path, fault: str, layout: dict, victim: int, tensorboard: bool = False, **options: object) -> dict:
    procs = start("tests.distributed.hang_ranks:run", WORLD, root / "out", environment=ENVIRONMENT, fault=fault,
                  layout=layout, victim=victim, folder=str(root / "logs"), stamp=str(root / "stamp"),
                  tensorboard=tensorboard, **options)
    ended = exits(procs, timeout=240)
    logs = {rank: (root / "out" / f"rank{rank}.log").read_text() for rank in range(WORLD)}
    assert len(ended) == WORLD, f"ranks {set(range(WORLD)) - set(ended)} still ran:\n{logs}"
    assert (root / "stamp").exists(), f"the fault never happened:\n{logs[victim][-3000:]}"
    fault_at = float((root / "stamp").read_text())
    print(f"{fault} {layout} victim {victim}: exits", {r: (c, round(t - fault_at, 1)) for r, (c, t) in ended.items()})
    for rank, (code, at) in ended.items():
        assert code != 0, f"rank {rank} exited 0:\n{logs[rank][-3000:]}"
        assert at - fault_at <= TIMEOUT_S + 30, f"rank {rank} exited {at - fault_at:.1f} s after the fault"
    diagnostics = root / "logs" / "diagnostics"
    assert (diagnostics / "hang.json").exists(), "\n".join(log[-2000:] for log in logs.values())
    report = json.loads((diagnostics / "hang.json").read_text())
    live = [rank for rank, (code, _) in ended.items() if code > 0]
    for rank in live:  # every live rank wrote its files and printed the verdict
        assert "lightning-nd diagnostics: hang verdict" in logs[rank], logs[rank][-3000:]
        for name in ("capture.json", "stacks.txt"):
            assert (diagnostics / f"rank{rank}" / name).is_file(), (rank, name)
        assert (diagnostics / "fr" / f"fr_rank_{rank}").is_file(), rank
    record = diagnostics / "run.json"  # the sweep's row (`RunSummary`), from rank 0 when it lived to write it
    run = json.loads(record.read_text()) if record.is_file() else None
    assert (run is not None) == (ended[0][0] > 0), (ended[0], run)
    return {"report": report, "logs": logs, "ended": ended, "diagnostics": diagnostics, "run": run}


def _culprit(report: dict, rank: int) -> dict:
    culprits = {c["rank"]: c for c in report["culprits"]}
    assert list(culprits) == [rank], report["summary"]
    return culprits[rank]


def test_rank_that_skips_a_collective_under_dp_shard(tmp_path):
    run = _run(tmp_path, "skip", {"dp_shard": 4}, victim=2)
    culprit = _culprit(run["report"], 2)
    assert culprit["kind"] == "skipped" and culprit["dim"] == "dp_shard" and culprit["op"] == "all_reduce"
    skipped = _line("dist.all_reduce(torch.ones(4), group=group)")  # the first of the two syncs
    assert culprit["frame"].endswith(f"hang_ranks.py:{skipped} in misbehave")
    assert "rank 2 (dp_shard 2) skipped all_reduce" in run["report"]["summary"][0]
    assert run["run"] == {**run["run"], "status": "hang", "reason": run["report"]["summary"][0]}


def test_rank_zero_killed_under_dp_shard_store_gone(tmp_path):
    run = _run(tmp_path, "kill", {"dp_shard": 4}, victim=0)
    culprit = _culprit(run["report"], 0)
    assert culprit["kind"] == "dead" and culprit["dim"] == "dp_shard" and run["report"]["dead"] == [0]
    assert culprit["op"] == "all_gather"  # its peers were in the forward's first FSDP all-gather
    assert run["ended"][0][0] == -9 and run["report"]["captured"] == [1, 2, 3]
    for rank in (1, 2, 3):  # the store died with rank 0: each survivor still names it
        assert "lightning-nd: rank 0 died or is unreachable: the rendezvous store" in run["logs"][rank]
    assert run["run"] is None  # rank 0 died: the sweep's row says it left no record


def test_rank_stuck_in_python_under_dp_shard_x_tp(tmp_path):
    run = _run(tmp_path, "stuck", {"dp_shard": 2, "tp": 2}, victim=3, tensorboard=True)
    culprit = _culprit(run["report"], 3)
    # rank 3 is awaited by its tp partner (a TP all-reduce) and by its fsdp partner (an all-gather): either is right
    assert culprit["kind"] == "stuck"
    assert (culprit["dim"], culprit["op"]) in {("tp", "all_reduce"), ("fsdp", "all_gather")}
    assert culprit["frame"].endswith(f"hang_ranks.py:{_line('time.sleep(600)')} in misbehave")
    assert "rank 3 (dp_shard 1, tp 1) never joined" in run["report"]["summary"][0]
    assert run["run"] == {**run["run"], "status": "hang", "reason": run["report"]["summary"][0]}
    # torch's own analyzer reads our gloo dumps and finds rank 3 missing too
    torch_says = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                                 str(run["diagnostics"] / "fr")], capture_output=True, text=True, timeout=120)
    said = torch_says.stdout + torch_says.stderr  # its report goes to the log (stderr)
    assert torch_says.returncode == 0 and "Traceback" not in said, said[-3000:]
    missing = re.findall(r"missing ranks: \{([\d, ]+)\}\n.*?expected ranks: \{([\d, ]+)\}", said, re.S)
    assert any("3" in ranks.split(", ") and "3" in expected.split(", ") for ranks, expected in missing), said[-3000:]
    _assert_cards(tmp_path / "logs")


def _assert_cards(folder: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = next(folder.glob("tb/version_*"))
    accumulator = EventAccumulator(str(events), size_guidance={"tensors": 0})
    accumulator.Reload()
    tags = accumulator.Tags()["tensors"]
    assert "diagnostics/hang/text_summary" in tags and "diagnostics/topology/text_summary" in tags, tags
    card = accumulator.Tensors("diagnostics/hang/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "| 3 | stuck |" in card, card
    topology = accumulator.Tensors("diagnostics/topology/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "| backend | gloo |" in topology and "hosted by rank 0's process" in topology, topology


def test_rank_that_issues_another_size_under_dp_shard_x_tp(tmp_path):
    run = _run(tmp_path, "size", {"dp_shard": 2, "tp": 2}, victim=1)
    culprit = _culprit(run["report"], 1)
    assert culprit["kind"] == "mismatch" and culprit["dim"] == "tp" and culprit["op"] == "all_reduce"
    assert "all_reduce(8; Float)" in culprit["detail"] and "all_reduce(4; Float)" in culprit["detail"]
    assert run["ended"][0][0] == -6 and 0 in run["report"]["dead"]  # gloo aborted the rank that received more


def test_pipeline_stage_that_never_sends(tmp_path):
    run = _run(tmp_path, "never_send", {"pp": 2, "dp_shard": 2}, victim=0)
    culprit = _culprit(run["report"], 0)
    assert culprit["kind"] == "never_sent" and culprit["dim"] == "pp" and culprit["group_ranks"] == [0, 2]
    assert culprit["op"] == "send"
    assert "never sent fwd/0 of step 2 to rank 2" in culprit["detail"]
    assert run["run"]["status"] == "hang", run["run"]  # rank 0 itself never sent: it waits in its next receive


def test_rank_killed_mid_step_under_pp_x_dp_shard(tmp_path):
    run = _run(tmp_path, "kill", {"pp": 2, "dp_shard": 2}, victim=1)
    culprit = _culprit(run["report"], 1)
    assert culprit["kind"] == "dead" and run["report"]["dead"] == [1] and run["ended"][1][0] == -9
    assert (culprit["dim"], culprit["op"]) == ("fsdp", "all_gather")  # its stage partner waited in the forward
    assert run["run"]["status"] == "crash" and "rank 1" in run["run"]["reason"], run["run"]


def test_stage_stuck_in_python_under_pp_x_dp_shard(tmp_path):
    run = _run(tmp_path, "stuck", {"pp": 2, "dp_shard": 2}, victim=2)
    culprit = _culprit(run["report"], 2)
    assert (culprit["kind"], culprit["dim"], culprit["op"]) == ("stuck", "fsdp", "all_gather")
    assert culprit["frame"].endswith(f"hang_ranks.py:{_line('time.sleep(600)')} in misbehave")
    assert run["run"]["status"] == "hang" and run["run"]["dims"]["pp"] == 2, run["run"]


def test_rank_stuck_at_an_epoch_boundary_under_cp_x_dp_shard(tmp_path):
    """Every step is also an epoch boundary (one batch per rank per epoch): the barriers the boundary adds on
    every rank are alike, no mismatch; the sleeping rank is the one named."""
    run = _run(tmp_path, "stuck", {"cp": 2, "dp_shard": 2}, victim=1, epoch_steps=True)
    culprit = _culprit(run["report"], 1)  # FSDP shards over dp_shard x cp: the flattened "fsdp" group
    assert (culprit["kind"], culprit["dim"], culprit["op"]) == ("stuck", "fsdp", "all_gather"), culprit
    assert culprit["frame"].endswith(f"hang_ranks.py:{_line('time.sleep(600)')} in misbehave")


def test_rank_stuck_in_python_under_ep(tmp_path):
    run = _run(tmp_path, "stuck", {"dp_shard": 4, "ep": 2}, victim=2, model="moe_llama")
    culprit = _culprit(run["report"], 2)  # its peers wait in FSDP's all-gather, before any expert exchange
    assert (culprit["kind"], culprit["dim"], culprit["op"]) == ("stuck", "dp_shard", "all_gather"), culprit
    assert run["run"]["status"] == "hang" and run["run"]["dims"]["ep"] == 2, run["run"]
    assert culprit["frame"].endswith(f"hang_ranks.py:{_line('time.sleep(600)')} in misbehave")
