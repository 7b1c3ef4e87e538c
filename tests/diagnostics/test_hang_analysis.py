"""The hang matcher (`diagnostics/analysis/hang.py`) on hand-built captures: one per way ranks go wrong, each checked
for the rank, dim, op and line it names, and for the ranks it must not blame."""

from __future__ import annotations

import json
from pathlib import Path

from diagnostics.__main__ import main
from diagnostics.analysis.hang import hang_report
from diagnostics.collect.environment import apply_environment, wanted_environment
from diagnostics.records import (
    CollectiveEntry,
    Frame,
    GroupRecord,
    HangReport,
    PointToPointRecord,
    RankCapture,
    from_dict,
    to_json,
    write_atomic,
)

TORCH = Frame("/venv/site-packages/torch/distributed/distributed_c10d.py", 3245, "all_reduce")
SLEEP = (Frame("/home/me/train.py", 88, "training_step"),
         Frame("/venv/site-packages/lightning/pytorch/loops.py", 1, "run"))
WAITING = (Frame("/venv/site-packages/torch/distributed/distributed_c10d.py", 4387, "wait"),
           Frame("/home/me/train.py", 70, "forward"))


def entry(group: str, seq: int, line: int, size: int = 4, retired: bool = True,
          op: str = "all_reduce") -> CollectiveEntry:
    return CollectiveEntry(group, seq, op, ((size,),), ("Float",), retired, 1_000_000_000_000 * 1_000_000_000 + seq,
                           (TORCH, Frame("/home/me/train.py", line, "training_step")))


def capture(rank: int, entries: list[CollectiveEntry], groups: list[GroupRecord], stack=WAITING, p2p=(),
            coordinates=None, world_size: int = 4) -> RankCapture:
    return RankCapture(rank, world_size, "rank 0 failed: timed out", 2, 1_000_000_000_100.0, tuple(entries),
                       tuple(p2p), {"MainThread": stack, "lightning-nd-watchdog": ()}, "MainThread", tuple(groups),
                       coordinates or {})


def history(group: str, upto: int, line: int = 50) -> list[CollectiveEntry]:
    return [entry(group, seq, line + seq % 3) for seq in range(1, upto + 1)]


DP = GroupRecord("1", "mesh_dp_shard", "dp_shard", (0, 1, 2, 3))


def test_a_rank_stuck_in_python_is_named_with_its_line_and_the_waiters_are_not():
    captures = {r: capture(r, [*history("1", 9), entry("1", 10, 60, retired=False)], [DP]) for r in (0, 1, 3)}
    captures[2] = capture(2, history("1", 9), [DP], stack=SLEEP)
    report = hang_report(captures, 4)
    assert [(c.rank, c.kind, c.dim, c.op, c.seq, c.frame) for c in report.culprits] == [
        (2, "stuck", "dp_shard", "all_reduce", 10, "/home/me/train.py:88 in training_step")]
    assert round(report.culprits[0].waited_s) == 100
    assert report.summary[0].startswith("rank 2 never joined all_reduce #10 on the dp_shard group [0, 1, 2, 3]")


def test_a_skipped_collective_is_found_by_alignment_not_by_sequence_numbers():
    # every rank calls line 60 then 61; rank 1 skips 60, so its 61 pairs with the others' 60 and it runs on
    # into a collective at line 70 that pairs with their 61
    others = [*history("1", 9), entry("1", 10, 60), entry("1", 11, 61, retired=False)]
    captures = {r: capture(r, others, [DP]) for r in (0, 2, 3)}
    captures[1] = capture(1, [*history("1", 9), entry("1", 10, 61), entry("1", 11, 70, size=99)], [DP])
    (culprit,) = hang_report(captures, 4).culprits
    assert (culprit.rank, culprit.kind, culprit.seq) == (1, "skipped", 10)
    assert culprit.frame == "/home/me/train.py:60 in training_step"  # the line it skipped, from its peers' frames


def test_a_size_mismatch_in_a_two_rank_group_is_settled_by_the_dims_other_groups():
    tp = {0: GroupRecord("5", "mesh_tp", "tp", (0, 1)), 1: GroupRecord("5", "mesh_tp", "tp", (0, 1)),
          2: GroupRecord("6", "mesh_tp", "tp", (2, 3)), 3: GroupRecord("6", "mesh_tp", "tp", (2, 3))}
    captures = {r: capture(r, [*history(tp[r].name, 5), entry(tp[r].name, 6, 80, size=8 if r == 1 else 4)], [tp[r]])
                for r in range(4)}
    (culprit,) = hang_report(captures, 4).culprits
    assert (culprit.rank, culprit.kind, culprit.dim, culprit.group_ranks) == (1, "mismatch", "tp", (0, 1))
    assert "all_reduce(8; Float)" in culprit.detail and "all_reduce(4; Float)" in culprit.detail
    del captures[0]  # the partner died (gloo aborts a rank that receives more than it expects): still rank 1
    report = hang_report(captures, 4, dead=[0])
    assert [c.rank for c in report.culprits] == [1] and report.dead == (0,) and report.missing == (0,)
    assert any(line.startswith("rank 0 died") and "(a consequence)" in line for line in report.summary)
    silent = hang_report(captures, 4)  # not known dead: named as silent, never as dead
    assert silent.dead == () and any(line.startswith("rank 0 left no capture") for line in silent.summary)


def test_a_rank_that_failed_by_itself_is_named_with_its_error_not_its_waiting_peers():
    captures = {r: capture(r, [*history("1", 4), entry("1", 5, 60)], [DP]) for r in range(4)}
    captures[1] = RankCapture(**{**captures[1].__dict__, "raised": True, "error": "failed: ValueError: bad batch"})
    for r in (0, 2, 3):
        captures[r] = RankCapture(**{**captures[r].__dict__, "raised": True})
    (culprit,) = hang_report(captures, 4).culprits
    assert (culprit.rank, culprit.kind) == (1, "failed")
    assert culprit.detail == "failed by itself: failed: ValueError: bad batch"


def test_uneven_all_to_all_sizes_are_no_mismatch():
    ep = GroupRecord("9", "mesh_ep", "ep", (0, 1, 2, 3))
    def routed(rank, retired=True):
        return CollectiveEntry("9", 3, "all_to_all_single", ((10 + rank, 64),), ("Float",), retired, 1,
                               (TORCH, Frame("/home/me/moe.py", 30, "forward")))
    captures = {r: capture(r, [*history("9", 2), routed(r, retired=False)], [ep]) for r in (0, 1, 3)}
    captures[2] = capture(2, history("9", 2), [ep], stack=SLEEP)
    (culprit,) = hang_report(captures, 4).culprits
    assert (culprit.rank, culprit.kind, culprit.op) == (2, "stuck", "all_to_all_single")


def test_two_ranks_that_disagree_with_nobody_to_settle_it_are_both_named():
    tp = GroupRecord("5", "mesh_tp", "tp", (0, 1))
    captures = {r: capture(r, [*history("5", 3), entry("5", 4, 80, size=4 + 4 * r)], [tp], world_size=2)
                for r in (0, 1)}
    report = hang_report(captures, 2)
    assert [(c.rank, c.kind) for c in report.culprits] == [(0, "mismatch"), (1, "mismatch")]


def test_other_pipeline_stages_are_not_compared_with_each_other():
    coords = {str(r): {"pp": r // 2, "dp_shard": r % 2} for r in range(4)}
    dp = {r: GroupRecord(str(10 + r // 2), "mesh_dp_shard", "dp_shard", (2 * (r // 2), 2 * (r // 2) + 1))
          for r in range(4)}
    captures = {r: capture(r, [entry(dp[r].name, 1, 90, size=100 * (1 + r // 2))], [dp[r]], coordinates=coords)
                for r in (1, 2, 3)}
    report = hang_report(captures, 4, dead=[0])
    assert [(c.rank, c.kind) for c in report.culprits] == [(0, "dead")]
    assert report.culprits[0].dim == "dp_shard" and report.culprits[0].group_ranks == (0, 1)


def test_a_dead_rank_is_named_from_its_peers_dumps():
    captures = {r: capture(r, [*history("1", 4), entry("1", 5, 60, retired=False)], [DP]) for r in (0, 1, 2)}
    report = hang_report(captures, 4, dead=[3])
    (culprit,) = report.culprits
    assert (culprit.rank, culprit.kind, culprit.op, culprit.seq) == (3, "dead", "all_reduce", 5)
    assert report.missing == (3,) and "died; its peers waited for it in all_reduce(4; Float)" in culprit.detail
    assert culprit.detail.endswith("it last joined all_reduce(4; Float) at /home/me/train.py:51 in training_step #4")


def test_a_rank_waiting_elsewhere_is_a_consequence_of_the_one_it_waits_for():
    # tp pairs (0,1) and (2,3), dp pairs (0,2) and (1,3): rank 3 sleeps; rank 1 waits for it in dp and so never
    # joins rank 0's tp collective; rank 2 waits for 3 in tp
    tp = {r: GroupRecord("5" if r < 2 else "6", "mesh_tp", "tp", (0, 1) if r < 2 else (2, 3)) for r in range(4)}
    dp = {r: GroupRecord("7" if r % 2 == 0 else "8", "mesh_dp_shard", "dp_shard", (0, 2) if r % 2 == 0 else (1, 3))
          for r in range(4)}
    captures = {
        0: capture(0, [*history("5", 3), entry("5", 4, 70, retired=False), *history("7", 2)], [tp[0], dp[0]]),
        1: capture(1, [*history("5", 3), *history("8", 2), entry("8", 3, 71, retired=False)], [tp[1], dp[1]]),
        2: capture(2, [*history("6", 3), entry("6", 4, 70, retired=False), *history("7", 2)], [tp[2], dp[2]]),
        3: capture(3, [*history("6", 3), *history("8", 2)], [tp[3], dp[3]], stack=SLEEP),
    }
    (culprit,) = hang_report(captures, 4).culprits
    assert (culprit.rank, culprit.kind, culprit.frame) == (3, "stuck", "/home/me/train.py:88 in training_step")


def _p2p(op: str, peer: int, state: str, tag: str, step: int = 2) -> PointToPointRecord:
    return PointToPointRecord(op, peer, "pp", state, step, tag, 512, 1.0)


def test_a_stage_that_skipped_a_send_is_named_not_the_stage_it_blocked():
    pp = {0: GroupRecord("3", "mesh_pp", "pp", (0, 1)), 1: GroupRecord("3", "mesh_pp", "pp", (0, 1))}
    sender = [_p2p("send", 1, "issued", f"fwd/{c}") for c in (1, 2, 3)]
    sender += [_p2p("recv", 1, "issued", f"bwd/{c}") for c in range(4)] + [_p2p("recv", 1, "completed", "bwd/0")]
    receiver = [_p2p("recv", 0, "issued", f"fwd/{c}") for c in range(4)]
    receiver += [_p2p("recv", 0, "completed", f"fwd/{c}") for c in range(3)]
    receiver += [_p2p("send", 0, "issued", f"bwd/{c}") for c in range(3)]
    captures = {0: capture(0, [], [pp[0]], p2p=sender, world_size=2),
                1: capture(1, [], [pp[1]], p2p=receiver, world_size=2)}
    (culprit,) = hang_report(captures, 2).culprits
    assert (culprit.rank, culprit.kind, culprit.dim, culprit.group_ranks) == (0, "never_sent", "pp", (0, 1))
    assert culprit.detail == "never sent fwd/0 of step 2 to rank 1"


def test_a_dead_stage_is_named_with_what_its_neighbour_waited_for():
    pp = GroupRecord("3", "mesh_pp", "pp", (0, 1))
    receiver = [_p2p("recv", 0, "issued", "fwd/0"), _p2p("recv", 0, "completed", "fwd/0"),
                _p2p("recv", 0, "issued", "fwd/1")]
    report = hang_report({1: capture(1, [], [pp], p2p=receiver, world_size=2)}, 2, dead=[0])
    (culprit,) = report.culprits
    assert (culprit.rank, culprit.kind, culprit.dim) == (0, "dead", "pp")
    assert culprit.detail == "died (rank 1 waited for its fwd/1 (step 2))"


def test_records_round_trip_through_json_and_the_cli_reads_a_run_folder(tmp_path, capsys):
    captures = {r: capture(r, [*history("1", 9), entry("1", 10, 60, retired=False)], [DP]) for r in (0, 1, 3)}
    captures[2] = capture(2, history("1", 9), [DP], stack=SLEEP)
    for rank, one in captures.items():
        assert from_dict(RankCapture, json.loads(to_json(one))) == one
        write_atomic(tmp_path / "diagnostics" / f"rank{rank}" / "capture.json", to_json(one))
    report = hang_report(captures, 4)
    assert from_dict(HangReport, json.loads(to_json(report))) == report
    assert main(["hang", str(tmp_path)]) == 1
    assert "rank 2 never joined all_reduce #10 on the dp_shard group" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main(["hang", str(tmp_path / "empty")]) == 2 and "no capture in" in capsys.readouterr().err
    assert main(["hang", str(tmp_path / "absent")]) == 2


def test_environment_keeps_what_the_user_set(tmp_path: Path):
    wanted = wanted_environment("nccl", 3, tmp_path, distributed_debug="DETAIL")
    assert wanted["NCCL_DEBUG_FILE"] == str(tmp_path / "nccl" / "nccl.rank3.%h.%p.log")
    assert wanted["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "fr" / "fr_rank_")
    assert wanted["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL" and wanted["TORCH_FR_BUFFER_SIZE"] == "2000"
    environ = {"NCCL_DEBUG": "WARN"}
    applied, kept = apply_environment(wanted, environ)
    assert kept == {"NCCL_DEBUG": "WARN"} and environ["NCCL_DEBUG"] == "WARN" and "NCCL_DEBUG" not in applied
    assert environ["NCCL_DEBUG_SUBSYS"] == "INIT,ENV,NET,GRAPH"
    assert set(wanted_environment("gloo", 0, tmp_path)) == {"TORCH_FR_BUFFER_SIZE"}


def _torch_entry(seq: int, line: int, retired: bool = True) -> dict:
    """One entry as torch's flight recorder dumps it (NCCL runs write these files themselves)."""
    return {"record_id": seq, "pg_id": 1, "process_group": ("1", "mesh_dp_shard"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": "nccl:all_reduce", "time_created_ns": seq * 10**9,
            "input_sizes": [[4]], "input_dtypes": ["Float"], "output_sizes": [[4]], "output_dtypes": ["Float"],
            "state": "completed" if retired else "started", "retired": retired, "is_p2p": False, "timeout_ms": 600000,
            "frames": [{"name": "training_step", "filename": "/home/me/train.py", "line": line}]}


def test_the_cli_decides_from_flight_recorder_dumps_alone(tmp_path, capsys):
    import pickle

    config = {"1": {"name": "1", "desc": "mesh_dp_shard", "ranks": "[0, 1, 2, 3]"}}
    for rank in range(4):
        entries = [_torch_entry(seq, 40 + seq) for seq in range(1, 6)]
        if rank != 1:
            entries.append(_torch_entry(6, 46, retired=False))
        dump = {"version": "2.10", "pg_config": config, "pg_status": {}, "entries": entries}
        (tmp_path / f"fr_rank_{rank}").write_bytes(pickle.dumps(dump))
    assert main(["hang", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "rank 1 never joined all_reduce #6 on the dp_shard group [0, 1, 2, 3]; its stack was not captured" in out
    (tmp_path / "fr_rank_2").write_bytes(b"not a pickle")
    assert main(["hang", str(tmp_path)]) == 2 and "fr_rank_2" in capsys.readouterr().err


def test_the_cli_keeps_pipeline_stages_apart_with_the_runs_layout(tmp_path, capsys):
    import pickle

    for rank in (1, 2, 3):  # rank 0's dump is missing; each stage's dp group moves its own layers' sizes
        name, members = ("10", "[0, 1]") if rank < 2 else ("11", "[2, 3]")
        entries = [{**_torch_entry(seq, 40), "process_group": (name, "mesh_dp_shard"),
                    "input_sizes": [[100 if rank < 2 else 200]]} for seq in (1, 2)]
        dump = {"pg_config": {name: {"name": name, "desc": "mesh_dp_shard", "ranks": members}}, "entries": entries}
        (tmp_path / f"fr_rank_{rank}").write_bytes(pickle.dumps(dump))
    assert main(["hang", str(tmp_path)]) == 1
    assert "rank 1 disagrees" in capsys.readouterr().out  # without coordinates the stages look like one dim
    layout = {"ranks": [{"rank": r, "coordinates": {"pp": r // 2, "dp_shard": r % 2}} for r in range(4)]}
    (tmp_path / "layout.json").write_text(json.dumps(layout))
    assert main(["hang", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "disagrees" not in out and "rank 0 (pp 0, dp_shard 0) left no capture" in out


def test_the_same_call_reached_through_another_path_of_lightnings_loop_is_no_mismatch():
    """One rank sleeps at step 3 where every step ends an epoch: its peers reach the loss group's barrier, one of
    them through another line of Lightning's loop (the epoch's end) than the others. The same call as the user
    sees it (op, buffers, the user's line) is no mismatch; the sleeping rank, behind and in Python, is named."""
    loss = GroupRecord("2", "mesh_loss", "loss", (0, 1, 2, 3))
    user = Frame("/home/me/train.py", 30, "main")

    def barrier(seq: int, loop_line: int, retired: bool = True) -> CollectiveEntry:
        frames = (Frame("/venv/site-packages/torch/distributed/distributed_c10d.py", 4200, "barrier"),
                  Frame("/venv/site-packages/lightning/pytorch/loops/fit_loop.py", loop_line, "on_advance_end"), user)
        return CollectiveEntry("2", seq, "barrier", (), (), retired, 1_000_000_000_000 * 1_000_000_000 + seq, frames)

    done = [barrier(seq, 100) for seq in range(1, 4)]
    captures = {rank: capture(rank, [*done, barrier(4, 120 if rank == 0 else 110, retired=False)], [loss])
                for rank in (0, 1, 3)}
    captures[2] = capture(2, done, [loss], stack=SLEEP)
    report = hang_report(captures, 4)
    assert [(c.rank, c.kind, c.dim, c.op, c.seq, c.frame) for c in report.culprits] == [
        (2, "stuck", "loss", "barrier", 4, "/home/me/train.py:88 in training_step")], report.summary
    different = {rank: capture(rank, [*done, entry("2", 4, 61 if rank == 0 else 60, retired=False)], [loss])
                 for rank in (0, 1, 3)}  # another line of the user's own code: still a mismatch
    assert [(c.rank, c.kind) for c in hang_report(different, 4).culprits][:1] == [(0, "mismatch")]
