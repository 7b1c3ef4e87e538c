"""Checkpoint folders crafted by a stranger, each case one that db1c3e6 got wrong: an index that is not DCP's with a
rank-local one beside it that runs code, a shard named by an absolute path, manifest entries outside the folder or
naming a device, a pickle bomb through an allowed function, manifests that are malformed or dated in the future, two
runs sharing a folder, and a crash at every step of replacing a checkpoint (synchronous and `async_save`). Each ends in
one `CheckpointError` (or a skip with one warning) within seconds, runs nothing and reads nothing outside its folder."""

from __future__ import annotations

import _codecs
import json
import logging
import os
import pickle
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_nd.checkpoint import CheckpointError, files, listing, read_sharded, trusted
from lightning_nd.checkpoint import commit as commit_module
from lightning_nd.checkpoint.__main__ import main
from lightning_nd.checkpoint.checked_reader import read_index
from tests.unit.checkpoint_folders import RUN, one_rank_checkpoint, staged
from tests.unit.test_trusted_checkpoint import Touches, replace

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def write(path: Path, step: int = 1, legacy: bool = False) -> None:
    state = {"model": {"w": torch.full((4, 3), float(step))}}
    one_rank_checkpoint(path, state, {"global_step": step, "lightning_nd": {"param_names": []}}, legacy=legacy,
                        info={"global_step": step})


def manifest_of(path: Path) -> dict:
    return json.loads((path / files.MANIFEST).read_text())


def rewrite_manifest(path: Path, manifest: object) -> None:
    (path / files.MANIFEST).write_text(json.dumps(manifest))


def test_an_index_that_is_not_dcps_with_a_rank_local_one_beside_it_runs_nothing(tmp_path, capsys):
    """`.metadata` unpickles to None (it names no global); DCP then reads `__0.metadata` with a plain pickle.load."""
    path, marker = tmp_path / "step=1.ckpt", tmp_path / "ran"
    write(path)
    replace(path, files.DCP_METADATA, pickle.dumps(None))
    (path / "__0.metadata").write_bytes(pickle.dumps(Touches(marker)))
    with pytest.raises(CheckpointError, match=r"is not DCP's index \(it unpickles to a `NoneType`\)"):
        read_sharded(path, progress=lambda _: None)
    assert main(["export", str(path), str(tmp_path / "out.safetensors")]) == 2
    assert "is not DCP's index" in capsys.readouterr().err and not marker.exists()


@pytest.mark.parametrize("where", ["absolute", "above"])
def test_a_shard_named_outside_the_folder_is_refused(tmp_path, where):
    other, path = tmp_path / "other" / "step=9.ckpt", tmp_path / "mine" / "step=1.ckpt"
    write(other, step=9)
    write(path)
    metadata = pickle.loads((path / files.DCP_METADATA).read_bytes())  # written just now: ours
    outside = str(other / "__0_0.distcp") if where == "absolute" else "../../other/step=9.ckpt/__0_0.distcp"
    for stored in metadata.storage_data.values():
        stored.relative_path = outside
    replace(path, files.DCP_METADATA, pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="which is not a file of this folder"):
        read_sharded(path, progress=lambda _: None)


@pytest.mark.parametrize("name", ["../../other/meta.pt", "/dev/zero", "a/b"])
def test_a_manifest_naming_a_file_outside_the_folder_is_refused_at_once(tmp_path, name, caplog):
    path = tmp_path / "step=1.ckpt"
    write(path)
    manifest = manifest_of(path)
    manifest["files"][name] = {"rank": 0, "bytes": 1 << 40, "crc32": 0}
    rewrite_manifest(path, manifest)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="which is not a file of this folder"):
        files.read_manifest(path)
    with caplog.at_level(logging.WARNING, logger="lightning_nd"):
        assert listing.complete_checkpoints(tmp_path) == []
    assert "skipped" in caplog.text and time.perf_counter() - start < 5


def test_a_link_or_a_pipe_in_the_folder_is_not_read(tmp_path):
    path = tmp_path / "step=1.ckpt"
    write(path)
    manifest = manifest_of(path)
    os.symlink("/dev/zero", path / "zeros")
    os.mkfifo(path / "pipe")
    manifest["files"] |= {"zeros": {"rank": 0, "bytes": 0, "crc32": 0}, "pipe": {"rank": 0, "bytes": 0, "crc32": 0}}
    rewrite_manifest(path, manifest)
    found = files.problems(path, files.read_manifest(path))
    assert found == ["`pipe` (written by rank 0) is not a regular file (a link, a device or a pipe)",
                     "`zeros` (written by rank 0) is not a regular file (a link, a device or a pipe)"]


def test_a_pickle_bomb_through_an_allowed_function_is_refused_without_the_memory(tmp_path):
    """28 nested `_codecs.encode(..., "hex")` in 2 KB would ask for 16 GB; only latin-1 text is allowed through."""
    class Encoded:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def __reduce__(self) -> tuple:
            return _codecs.encode, (self.inner, "hex")

    bomb: object = b"x" * 64
    for _ in range(28):
        bomb = Encoded(bomb)
    file = tmp_path / files.LEGACY_META
    file.write_bytes(pickle.dumps({"hyper_parameters": bomb}, protocol=2))
    assert file.stat().st_size < 2048
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"_codecs.encode of a bytes to 'hex'"):
        trusted.load_meta(file)
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("manifest,why", [
    ([], "not an object"), ({"files": {}}, "not a time"), ("not json", "corrupt"),
    ({"format": 2, "saved_at": "yesterday", "files": {"x": {}}}, "not a time"),
    ({"format": 2, "saved_at": 1.0, "files": {"x": {"rank": "0", "bytes": 1, "crc32": 1}}}, "not a rank"),
])
def test_a_malformed_manifest_is_skipped_with_one_warning_and_the_older_one_taken(tmp_path, caplog, manifest, why):
    write(tmp_path / "step=1.ckpt", step=1)
    write(tmp_path / "step=2.ckpt", step=2)
    if manifest == "not json":
        (tmp_path / "step=2.ckpt" / files.MANIFEST).write_text("{")
    else:
        rewrite_manifest(tmp_path / "step=2.ckpt", manifest)
    with caplog.at_level(logging.WARNING, logger="lightning_nd"):
        assert listing.complete_checkpoints(tmp_path) == [tmp_path / "step=1.ckpt"]
    assert caplog.text.count("skipped") == 1 and why in caplog.text


@pytest.mark.parametrize("saved_at", [1e300, float("nan"), float("inf")])
def test_a_manifest_dated_in_the_future_or_not_a_time_never_wins(tmp_path, caplog, saved_at):
    write(tmp_path / "step=1.ckpt", step=1)
    write(tmp_path / "step=2.ckpt", step=2)
    rewrite_manifest(tmp_path / "step=2.ckpt", manifest_of(tmp_path / "step=2.ckpt") | {"saved_at": saved_at})
    with caplog.at_level(logging.WARNING, logger="lightning_nd"):
        assert listing.resume_path(tmp_path) == str(tmp_path / "step=1.ckpt")
    assert "skipped" in caplog.text


def test_a_run_resumes_its_own_newest_and_one_with_none_says_whose_it_takes(tmp_path):
    write(tmp_path / "step=1.ckpt", step=1)  # this test's run (`RUN`)
    write(tmp_path / "step=5.ckpt", step=5)
    rewrite_manifest(tmp_path / "step=5.ckpt", manifest_of(tmp_path / "step=5.ckpt") | {"run": "slurm-99"})
    found = listing.complete_manifests(tmp_path, run=RUN)
    assert [path.name for path, _ in found] == ["step=1.ckpt", "step=5.ckpt"]  # its own, though older
    newcomer = listing.complete_manifests(tmp_path, run="slurm-100")
    assert newcomer[0][0].name == "step=5.ckpt" and listing.whose(newcomer[0][1], "slurm-100") == \
        "written by run `slurm-99`"
    assert listing.whose(found[0][1], RUN) == ""


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_two_runs_saving_one_name_keep_each_others_staging(tmp_path, one_rank_group, monkeypatch):
    from lightning_nd.checkpoint.sharded import STALE_STAGING_S, begin_save

    path = tmp_path / "last.ckpt"
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    first = begin_save(path, {"global_step": 1})
    (first / "__0_0.distcp").write_bytes(b"half")
    monkeypatch.setenv("SLURM_JOB_ID", "2")
    second = begin_save(path, {"global_step": 2})
    assert first != second and (first / "__0_0.distcp").exists()  # the first job's save in progress is left alone
    old = time.time() - STALE_STAGING_S - 60
    for entry in [first, *first.iterdir()]:
        os.utime(entry, (old, old))
    begin_save(path, {"global_step": 3})
    assert not first.exists()  # idle for over an hour: a save that died


STEPS = ["manifest", "fsync", "exchange", "rename", "rmtree"]


def _crash_at(monkeypatch, step: str, nth: int, in_thread: bool = False) -> None:
    """The ``nth`` call of the file system operation ``step`` during a commit fails, as a crash there would (only in
    a thread other than the main one with ``in_thread``: an async save's commit, not the save that clears leftovers)."""
    calls = {"n": 0}

    def failing(real):
        def call(*args, **kwargs):
            if in_thread and threading.current_thread() is threading.main_thread():
                return real(*args, **kwargs)
            calls["n"] += 1
            if calls["n"] == nth:
                raise KeyboardInterrupt(f"crash at {step} #{nth}")
            return real(*args, **kwargs)
        return call

    target = {"fsync": (os, "fsync"), "exchange": (commit_module, "exchange"), "rename": (os, "rename"),
              "rmtree": (shutil, "rmtree"), "manifest": (json, "dump")}[step]
    monkeypatch.setattr(*target, failing(getattr(*target)))


@pytest.mark.parametrize("swap", ["exchange", "two renames"])
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_crash_at_any_step_of_replacing_a_checkpoint_leaves_a_complete_one(tmp_path, monkeypatch, swap, step, nth):
    path = tmp_path / "last.ckpt"
    write(path, step=1)
    if swap == "two renames":  # a file system that cannot swap two folders in one step
        monkeypatch.setattr(commit_module, "exchange", lambda first, second: False)
    staging = staged(path, {"model": {"w": torch.full((4, 3), 2.0)}}, {"global_step": 2})
    with monkeypatch.context() as crashing:
        _crash_at(crashing, step, nth)
        try:
            commit_module.commit(staging, path, files.own_files(staging, 0), {"global_step": 2}, run=RUN)
        except KeyboardInterrupt:
            pass
    found = listing.complete_manifests(tmp_path, run=RUN)
    assert found, sorted(p.name for p in tmp_path.iterdir())
    assert found[0][1]["global_step"] in (1, 2)
    assert torch.equal(read_sharded(found[0][0], progress=lambda _: None)["state_dict"]["w"],
                       torch.full((4, 3), float(found[0][1]["global_step"])))
    write(path, step=3)  # and the next save of that name puts a complete one in place
    assert listing.complete_manifests(tmp_path, run=RUN)[0][1]["global_step"] == 3


def test_an_async_save_failing_in_its_commit_leaves_the_previous_checkpoint(tmp_path, one_rank_group, monkeypatch):
    from lightning_nd.checkpoint.async_save import AsyncSaver
    from lightning_nd.checkpoint.sharded import save_sharded

    path, info = tmp_path / "last.ckpt", {"world_size": 1}
    save_sharded(path, {"model": {"w": torch.ones(2)}}, {"global_step": 1}, {"torch": torch.get_rng_state()},
                 info | {"global_step": 1})
    saver = AsyncSaver(__import__("datetime").timedelta(seconds=60))
    for step in STEPS[2:]:  # the swap and what follows it, in the commit thread
        with monkeypatch.context() as crashing:
            _crash_at(crashing, step, 1, in_thread=True)
            saver.save(path, {"model": {"w": torch.zeros(2)}}, {"global_step": 2}, {"torch": torch.get_rng_state()},
                       info | {"global_step": 2}, 2)
            with pytest.raises((CheckpointError, KeyboardInterrupt), match=f"crash at {step}"):
                saver.wait(60)
        found = listing.complete_manifests(tmp_path)
        assert found and found[0][1]["global_step"] in (1, 2), step
        assert read_index(found[0][0])
    saver.save(path, {"model": {"w": torch.zeros(2)}}, {"global_step": 3}, {"torch": torch.get_rng_state()},
               info | {"global_step": 3}, 3)
    saver.wait(60)
    assert listing.complete_manifests(tmp_path)[0][1]["global_step"] == 3
