"""A rank SIGKILLed mid-step or mid-save: every other rank exits non-zero within the timeout + 30 s,
naming the dead rank; the half-written checkpoint is never taken as the newest; the last complete one
resumes the run with the same losses as an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_nd.checkpoint import is_complete, latest_checkpoint, read_sharded
from tests.distributed.checkpoint_ranks import FAST_FAILURE, STEPS
from tests.launcher import exits, launch, start

WORLD = 4


def _die(scenario: str, root: Path, rank: int, step: int) -> dict[int, tuple[int, float]]:
    """Run a dying scenario; each rank's exit code and exit time after the victim's death."""
    procs = start(f"tests.distributed.checkpoint_ranks:{scenario}", WORLD, root / "out", ckpt_dir=str(root / "ckpt"),
                  stamp=str(root / "stamp"), rank=rank, step=step)
    ended = exits(procs, timeout=300)
    assert len(ended) == WORLD, f"ranks {set(range(WORLD)) - set(ended)} still ran 300 s later"
    died = float((root / "stamp").read_text())
    return {r: (code, at - died) for r, (code, at) in ended.items()}


def _assert_all_stopped_naming(root: Path, ended: dict[int, tuple[int, float]], victim: int) -> None:
    limit = FAST_FAILURE["timeout"] + 30
    assert ended[victim][0] == -9
    for rank, (code, after) in ended.items():
        if rank == victim:
            continue
        log = (root / "out" / f"rank{rank}.log").read_text()
        assert code != 0, f"rank {rank} exited 0 after rank {victim} died:\n{log[-3000:]}"
        assert after <= limit, f"rank {rank} took {after:.1f} s (limit {limit} s)"
        assert f"lightning-nd: rank {victim} died" in log, log[-3000:]


def test_sigkill_mid_step_stops_every_rank_naming_it(tmp_path):
    ended = _die("die_mid_step", tmp_path, rank=2, step=3)
    _assert_all_stopped_naming(tmp_path, ended, victim=2)
    latest = latest_checkpoint(tmp_path / "ckpt")
    assert latest is not None and latest.name == "step=3.ckpt"
    assert read_sharded(latest)["global_step"] == 3  # the last complete checkpoint loads (checksums too)
    log = (tmp_path / "out" / "rank0.log").read_text()
    assert "ckpt_path=" in log and "step=3.ckpt" in log  # the message says where to resume from
    for rank in (0, 1, 3):  # the verdict reached each survivor's listeners before the process exited
        events = [json.loads(line) for line in (tmp_path / f"events-rank{rank}.jsonl").read_text().splitlines()]
        verdicts = [e for e in events if e["event"] == "FailureVerdict"]
        assert verdicts and verdicts[0]["culprit"] == 2 and "died" in verdicts[0]["reason"], events[-3:]
        assert [e["step"] for e in events if e["event"] == "CheckpointSaved"] == [1, 2, 3]


@pytest.fixture(scope="module")
def mid_save(tmp_path_factory):
    root = tmp_path_factory.mktemp("mid_save")
    return root, _die("die_mid_save", root, rank=1, step=4)


def test_sigkill_mid_save_leaves_no_newest_half_checkpoint(mid_save):
    root, ended = mid_save
    _assert_all_stopped_naming(root, ended, victim=1)
    folder = root / "ckpt"
    [partial] = folder.glob(".step=4.ckpt.*.partial")
    assert partial.is_dir() and any(partial.glob("__1_*.distcp"))  # rank 1 had written its shards
    assert not is_complete(partial) and not (folder / "step=4.ckpt").exists()
    assert latest_checkpoint(folder).name == "step=3.ckpt"
    assert (folder / "last.ckpt").resolve().name == "step=3.ckpt"


def test_resume_from_last_after_the_crash_matches_an_uninterrupted_run(mid_save, tmp_path):
    root, _ = mid_save
    results = launch("tests.distributed.checkpoint_ranks:resume_last", WORLD, tmp_path / "out", timeout=600,
                     ckpt_dir=str(root / "ckpt"), fresh_dir=str(tmp_path / "fresh"))
    resumed, uninterrupted = results[0]["resumed"], results[0]["uninterrupted"]
    assert resumed["losses"] == uninterrupted["losses"][3:] and resumed["step"] == STEPS
    # The resumed run saved step 4 whole; the dead run's staging folder (another run's, minutes old) is left alone.
    assert is_complete(root / "ckpt" / "step=4.ckpt")
    assert [p for p in (root / "ckpt").glob(".step=4.ckpt.*.partial") if is_complete(p)] == []
