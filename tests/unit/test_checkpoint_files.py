"""Checkpoint folders without processes: a complete one verifies, exports and is found newest; a missing
manifest, a missing, truncated or corrupt file is refused naming the piece; the CLI says the same."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from lightning_nd.checkpoint import CheckpointError, export, files, is_complete, latest_checkpoint, listing, read_sharded
from lightning_nd.checkpoint.__main__ import main
from lightning_nd.checkpoint.export import is_safetensors, read_export
from tests.unit.checkpoint_folders import RUN, one_rank_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def write_checkpoint(path: Path, step: int = 1, optimizer_state: bool = True) -> dict[str, torch.Tensor]:
    """A one-rank checkpoint written the way `save_sharded` writes it (DCP, RNG, meta, manifest, commit)."""
    weights = {"model.w": torch.randn(4, 3), "model.b": torch.randn(3)}
    optimizer = {"state": {name: {"step": torch.tensor(2.0), "exp_avg": torch.ones_like(w)} for name, w in weights.items()},
                 "param_groups": [{"lr": 0.1}]}
    state = {"model": dict(weights), **({"optimizer_0": optimizer} if optimizer_state else {})}
    meta = {"global_step": step, "lightning_nd": {"layout": {"dp_shard": 1}, "world_size": 1,
                                                   "param_names": [[["model.w", "model.b"]]]}}
    one_rank_checkpoint(path, state, meta, info={"global_step": step})
    return weights


def test_complete_checkpoint_reads_whole_and_exports(tmp_path):
    weights = write_checkpoint(tmp_path / "step=1.ckpt")
    assert is_complete(tmp_path / "step=1.ckpt") and not files.staging_path(tmp_path / "step=1.ckpt", RUN).exists()
    whole = read_sharded(tmp_path / "step=1.ckpt", progress=lambda _: None)
    for name, value in weights.items():
        assert torch.equal(whole["state_dict"][name], value)
    optimizer = whole["optimizer_states"][0]
    assert optimizer["param_groups"] == [{"lr": 0.1, "params": [0, 1]}] and set(optimizer["state"]) == {0, 1}
    out = export(tmp_path / "step=1.ckpt", tmp_path / "w.safetensors", "safetensors", module="model", progress=lambda _: None)
    from safetensors.torch import load_file

    assert set(load_file(out)) == {"w", "b"}
    with pytest.raises(ValueError, match="HINT: choose one of model"):
        export(tmp_path / "step=1.ckpt", tmp_path / "x.safetensors", "safetensors", module="net", progress=lambda _: None)


def same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return type(got) is type(want) and len(got) == len(want) and all(same(a, b) for a, b in zip(got, want))
    return got == want


def test_a_safetensors_export_holds_the_whole_state_and_reads_back_as_the_torch_one(tmp_path):
    write_checkpoint(tmp_path / "step=1.ckpt")
    code_free = export(tmp_path / "step=1.ckpt", tmp_path / "all.safetensors", progress=lambda _: None)
    pickled = export(tmp_path / "step=1.ckpt", tmp_path / "all.ckpt", progress=lambda _: None)  # by its suffix
    assert is_safetensors(code_free) and not is_safetensors(pickled)
    got, want = read_export(code_free), torch.load(pickled, weights_only=False)
    assert same(got, want), (got.keys(), want.keys())


@pytest.mark.parametrize("damage,message", [
    ("manifest", "has no `lightning_nd.json`: its save never finished"),
    ("missing", "`__0_0.distcp` (written by rank 0) is missing"),
    ("truncated", "`__0_0.distcp` (written by rank 0) has 10 bytes"),
    ("grown", "were written (grown or replaced since)"),
    ("corrupt", "`__0_0.distcp` (written by rank 0) does not match its checksum (corrupt)"),
    ("meta", "`meta.json` (written by rank 0) is missing"),
])
def test_damaged_checkpoint_is_refused_naming_the_piece(tmp_path, capsys, damage, message):
    path = tmp_path / "step=1.ckpt"
    write_checkpoint(path)
    shard = path / "__0_0.distcp"
    if damage == "manifest":
        (path / files.MANIFEST).unlink()
    elif damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:10])
    elif damage == "grown":
        shard.write_bytes(shard.read_bytes() + b"more")
    elif damage == "corrupt":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        (path / files.META).unlink()
    with pytest.raises(CheckpointError) as error:
        read_sharded(path, progress=lambda _: None)
    assert message in str(error.value) and "HINT" in str(error.value)
    assert main(["verify", str(path)]) == 2 and message in capsys.readouterr().err


def test_latest_skips_half_written_and_damaged_folders(tmp_path, capsys):
    write_checkpoint(tmp_path / "step=1.ckpt", step=1)
    time.sleep(0.01)
    write_checkpoint(tmp_path / "step=2.ckpt", step=2)
    write_checkpoint(tmp_path / "step=9.ckpt", step=9)
    (tmp_path / "step=9.ckpt" / "__0_0.distcp").write_bytes(b"cut")  # truncated: not complete
    partial = files.staging_path(tmp_path / "step=10.ckpt", RUN)
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert latest_checkpoint(tmp_path).name == "step=2.ckpt"
    assert main(["latest", str(tmp_path)]) == 0 and capsys.readouterr().out.strip().endswith("step=2.ckpt")
    assert latest_checkpoint(tmp_path / "step=9.ckpt") is None


def test_saving_over_an_existing_checkpoint_replaces_it_whole(tmp_path):
    path = tmp_path / "last.ckpt"
    write_checkpoint(path, step=1)
    write_checkpoint(path, step=2)
    assert json.loads((path / files.MANIFEST).read_text())["global_step"] == 2 and is_complete(path)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_weights_only_checkpoint_reads_and_exports(tmp_path):
    write_checkpoint(tmp_path / "w.ckpt", optimizer_state=False)  # param names recorded, no optimizer saved
    whole = read_sharded(tmp_path / "w.ckpt", progress=lambda _: None)
    assert whole["optimizer_states"] == [] and set(whole["state_dict"]) == {"model.w", "model.b"}


def test_saving_onto_a_folder_that_is_no_checkpoint_is_refused(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="is a folder that is not a lightning-nd checkpoint"):
        files.check_target(tmp_path / "runs")
    write_checkpoint(tmp_path / "old.ckpt")
    files.check_target(tmp_path / "old.ckpt")  # an earlier checkpoint of that name may be replaced
    files.check_target(tmp_path / "new.ckpt")


def test_latest_ignores_links_and_refuses_a_missing_folder(tmp_path, capsys):
    write_checkpoint(tmp_path / "step=1.ckpt", step=1)
    (tmp_path / "last.ckpt").symlink_to("step=1.ckpt")
    assert latest_checkpoint(tmp_path).name == "step=1.ckpt"
    with pytest.raises(CheckpointError, match="is not a folder"):
        latest_checkpoint(tmp_path / "nowhere")
    assert main(["latest", str(tmp_path / "nowhere")]) == 2 and "is not a folder" in capsys.readouterr().err


def test_optimizer_state_of_an_optimizer_that_never_stepped_leaves_it_untouched():
    from lightning_nd.checkpoint.names import Names, group_names, optimizer_state

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW([{"params": model[1].parameters(), "weight_decay": 0.0},
                                   {"params": model[0].parameters()}], lr=0.1)
    state = optimizer_state(model, optimizer, Names())
    assert state["state"] == {} and not optimizer.state  # torch would have stepped it with lr 0
    assert [g["weight_decay"] for g in state["param_groups"]] == [0.0, 0.01]
    assert group_names(model, optimizer, Names()) == [["1.weight", "1.bias"], ["0.weight", "0.bias"]]


def test_positional_optimizer_state_maps_through_this_runs_groups():
    """torch numbers parameters group by group; a decay / no-decay split is not `named_parameters()` order."""
    from lightning_nd.checkpoint.full import _names_by_position
    from lightning_nd.checkpoint.names import Names

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW([{"params": model[1].parameters()}, {"params": model[0].parameters()}])
    saved = [{"param_groups": [{"params": [0, 1]}, {"params": [2, 3]}]}]
    assert _names_by_position(model, [optimizer], Names(), saved, Path("x")) == [
        [["1.weight", "1.bias"], ["0.weight", "0.bias"]]]
    with pytest.raises(CheckpointError, match="parameter groups differ"):
        _names_by_position(model, [optimizer], Names(), [{"param_groups": [{"params": [0, 1, 2, 3]}]}], Path("x"))


def test_complete_checkpoints_of_several_folders_newest_first_and_resume_path(tmp_path):
    for name, step in (("a/step=1.ckpt", 1), ("b/hpc_ckpt_1.ckpt", 2), ("a/step=3.ckpt", 3)):
        write_checkpoint(tmp_path / name, step)
        time.sleep(0.01)  # saved one after another
    write_checkpoint(tmp_path / "a" / "cut.ckpt")
    (tmp_path / "a" / "cut.ckpt" / files.MANIFEST).unlink()  # a save cut short: never a candidate
    (tmp_path / "a" / "last.ckpt").symlink_to(tmp_path / "a" / "step=3.ckpt")
    found = listing.complete_checkpoints(tmp_path / "a", tmp_path / "b", tmp_path / "a", tmp_path / "missing")
    assert [p.name for p in found] == ["step=3.ckpt", "hpc_ckpt_1.ckpt", "step=1.ckpt"]
    assert listing.resume_path(tmp_path / "b", tmp_path / "a") == str(tmp_path / "a" / "step=3.ckpt")
    assert listing.resume_path(tmp_path / "missing") is None


def test_an_unreadable_checkpoint_is_named_with_the_fix(tmp_path):
    path = tmp_path / "step=1.ckpt"
    write_checkpoint(path)
    (path / files.MANIFEST).unlink()
    (path / files.MANIFEST).mkdir()  # only a regular file is read
    with pytest.raises(CheckpointError, match=r"`.*step=1.ckpt/lightning_nd.json` is not a regular file .*HINT"):
        files.read_manifest(path)
    assert not is_complete(path) and listing.complete_checkpoints(tmp_path) == []
