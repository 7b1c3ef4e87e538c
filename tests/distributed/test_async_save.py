"""`NDParallel(async_save=True)`: each checkpoint equals the synchronous save of the same state and training goes on
bit for bit as with synchronous saves (dp_shard=2, and dp_shard=2 x tp=2); an older checkpoint is removed only once
the newer one has committed, and `last.ckpt` never names a folder that is not whole; a rank SIGKILLed while a save is
being committed leaves the checkpoint before it the newest complete one, and it loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_nd.checkpoint import is_complete, latest_checkpoint, read_sharded
from tests.distributed.async_save_ranks import STEPS, WRITE_DELAY_S
from tests.launcher import exits, launch, start

LAYOUTS = {"dp2": (2, {"dp_shard": 2}), "dp2_tp2": (4, {"dp_shard": 2, "tp": 2})}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    done = {}

    def run(name: str):
        if name not in done:
            world, layout = LAYOUTS[name]
            root = tmp_path_factory.mktemp(f"async_{name}")
            done[name] = root, launch("tests.distributed.async_save_ranks:sync_and_async", world, root / "out",
                                      timeout=300, root=str(root), layout=layout, top_k_run=name == "dp2")
        return done[name]

    return run


def _equal(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_checkpoint_equals_the_synchronous_one_and_training_is_the_same(runs, name):
    root, results = runs(name)
    for step in range(1, STEPS + 1):
        sync, later = read_sharded(root / "sync" / f"step={step}.ckpt"), read_sharded(root / "async" / f"step={step}.ckpt")
        assert len(later["optimizer_states"][0]["state"]) == len(later["state_dict"]) > 0
        for part in ("state_dict", "optimizer_states", "global_step", "lightning_nd", "loops"):  # weights, Adam, exactly
            _equal(later[part], sync[part], f"step {step} {part}")
    for rank_result in results:
        assert rank_result["async"]["losses"] == rank_result["sync"]["losses"]
        _equal(rank_result["async"]["after"], rank_result["sync"]["after"], "final parameters")
        saved, committed = rank_result["async"]["saved"], rank_result["async"]["committed"]
        assert [(step, flag) for step, flag, _ in saved] == [(step, False) for step in range(1, STEPS + 1)]
        assert [step for step, _ in committed] == list(range(1, STEPS + 1))
        # the write waits WRITE_DELAY_S in the background: the commit comes after it, the loop is blocked less
        assert all(seconds > WRITE_DELAY_S for _, seconds in committed)
        assert all(flag for _, flag, _ in rank_result["sync"]["saved"])
    assert latest_checkpoint(root / "async").name == f"step={STEPS}.ckpt"


def test_an_older_checkpoint_goes_only_once_the_newer_one_is_whole(runs):
    root, results = runs("dp2")
    removals = results[0]["top1"]["removals"]
    asked = [r for r in removals if r["what"] == "asked"]
    removed = [r for r in removals if r["what"] == "removed"]
    assert [r["step"] for r in removed] == [r["step"] for r in asked] == list(range(1, STEPS))
    # asked while the newer one was still being written (the deferral was needed), removed once it was whole
    assert any(r["step"] + 1 not in r["complete"] for r in asked), asked
    for r in removed:
        assert r["step"] + 1 in r["complete"], r
    for r in removals:  # every removal leaves a complete checkpoint; the link names a whole one or none yet
        assert r["complete"] and r["link_whole"] in (True, None), r
    assert sorted(p.name for p in (root / "top1").iterdir()) == ["last.ckpt", f"step={STEPS}.ckpt"]
    assert (root / "top1" / "last.ckpt").resolve().name == f"step={STEPS}.ckpt"
    assert results[0]["top1"]["losses"] == results[0]["sync"]["losses"]


def test_a_rank_killed_while_committing_leaves_the_previous_checkpoint_newest(tmp_path):
    step = 3
    procs = start("tests.distributed.async_save_ranks:die_while_committing", 2, tmp_path / "out",
                  ckpt_dir=str(tmp_path / "ckpt"), stamp=str(tmp_path / "stamp"), rank=1, step=step)
    ended = exits(procs, timeout=120)
    assert ended.get(1, (None,))[0] == -9 and ended.get(0, (0,))[0] not in (0, None), ended
    folder = tmp_path / "ckpt"
    [partial] = folder.glob(f".step={step}.ckpt.*.partial")
    assert partial.is_dir() and not is_complete(partial) and not (folder / f"step={step}.ckpt").exists()
    latest = latest_checkpoint(folder)
    assert latest is not None and latest.name == f"step={step - 1}.ckpt"
    assert read_sharded(latest)["global_step"] == step - 1  # it loads, checksums too
    # its removal was asked for when step 3 was saved, and never done: step 3 never committed
    assert sorted(p.name for p in folder.glob("step=*")) == [f"step={step - 1}.ckpt"]
    assert not Path(folder / "last.ckpt").resolve().exists()  # the link names step 3, which never appeared
