"""A checkpoint folder's pickles go through `lightning_nd.checkpoint.trusted`'s allow-list: a crafted ``meta.pt``,
``rng-0.pt``, ``.metadata`` or non-tensor value in a shard is refused naming the file, and what it would have run (it
creates a marker file; each crafted file is first shown to create it when read the old way) never runs, on every load
path (`read_sharded`, `load_sharded`, the export CLI). What a real Lightning run writes (a Hydra config in the
hyper-parameters, numpy's random state) reads back equal, and a resume through `NDParallel` loads it."""

from __future__ import annotations

import enum
import io
import json
import pathlib
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lightning_nd.checkpoint import CheckpointError, files, load_sharded, read_sharded, trusted
from lightning_nd.checkpoint.__main__ import main
from lightning_nd.checkpoint.names import Names
from lightning_nd.checkpoint.state_files import read_meta
from tests.unit.checkpoint_folders import one_rank_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Touches:
    """Unpickled, creates ``marker``: the stand-in for whatever code a crafted file would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return pathlib.Path.touch, (self.marker,)


class Color(enum.Enum):
    RED = 1


def write(path: Path, meta: Any = None, rng: Any = None, lr: Any = 0.1) -> None:
    """A one-rank checkpoint of format 1 (its state pickled), as lightning-nd wrote them up to db1c3e6."""
    weight = torch.randn(4, 3)
    group = {k: v for k, v in torch.optim.SGD([weight]).param_groups[0].items() if k != "params"} | {"lr": lr}
    state = {"model": {"w": weight}, "optimizer_0": {"state": {}, "param_groups": [group]}}
    one_rank_checkpoint(path, state, meta if meta is not None else {"lightning_nd": {"param_names": [[["w"]]]}}, rng,
                        legacy=True)


def replace(path: Path, name: str, data: bytes) -> None:
    """``name`` rewritten with the manifest to match, as whoever crafted the folder would."""
    (path / name).write_bytes(data)
    manifest = json.loads((path / files.MANIFEST).read_text())
    manifest["files"][name] |= {"bytes": len(data), "crc32": files.crc32(path / name)}
    (path / files.MANIFEST).write_text(json.dumps(manifest))


def crafted(path: Path, which: str, marker: Path) -> None:
    """A checkpoint whose ``which`` carries `Touches`; the old way of reading it creates the marker (then removed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    if which == "meta.pt":
        write(path, meta={"global_step": 1, "hyper_parameters": {"lr": Touches(marker)}})
        torch.load(path / files.LEGACY_META, weights_only=False)
    elif which == "rng-0.pt":
        write(path, rng={"torch": torch.get_rng_state(), "python": Touches(marker)})
        torch.load(path / files.rng_file(0, legacy=True), weights_only=False)
    elif which == ".metadata":
        write(path)
        metadata = pickle.loads((path / files.DCP_METADATA).read_bytes())  # written just now: ours
        metadata.planner_data = {"w": Touches(marker)}  # inside an otherwise real index
        replace(path, files.DCP_METADATA, pickle.dumps(metadata))
        dcp.FileSystemReader(path).read_metadata()
    else:  # a value in the shards: the optimizer's `lr`
        write(path, lr=Touches(marker))
        _load_state_dict({}, storage_reader=dcp.FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    assert marker.exists(), f"the crafted {which} did not run its code the old way: the test would prove nothing"
    marker.unlink()


FILES = ["meta.pt", "rng-0.pt", ".metadata", "value"]
NAMED = {"meta.pt": "meta.pt`", "rng-0.pt": "rng-0.pt`", ".metadata": ".metadata`",
         "value": "`optimizer_0.param_groups.0.lr`"}


@pytest.mark.parametrize("which", [name for name in FILES if name != "rng-0.pt"])  # one process reads no RNG file
def test_read_sharded_and_the_export_cli_refuse_a_crafted_file(tmp_path, capsys, which):
    path, marker = tmp_path / "step=1.ckpt", tmp_path / "ran"
    crafted(path, which, marker)
    with pytest.raises(CheckpointError) as error:
        read_sharded(path, progress=lambda _: None)
    message = str(error.value)
    assert NAMED[which] in message and ("getattr`" in message or "Path.touch`" in message), message
    assert "lightning-nd does not unpickle" in message and "HINT" in message and "add_safe_globals" in message
    assert main(["export", str(path), str(tmp_path / "out.ckpt")]) == 2
    assert NAMED[which] in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out.ckpt").exists()


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("which", FILES)
def test_load_sharded_refuses_a_crafted_file(tmp_path, one_rank_group, which):
    path, marker = tmp_path / "step=1.ckpt", tmp_path / "ran"
    crafted(path, which, marker)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with pytest.raises(CheckpointError, match=NAMED[which].replace(".", r"\.")):
        load_sharded(path, model, [optimizer], Names())
    assert not marker.exists()
    if which != "value":  # refused before any weights were read
        assert torch.equal(model.w, torch.zeros(4, 3))


def test_the_users_own_types_are_named_and_can_be_trusted_explicitly(tmp_path):
    file = tmp_path / files.LEGACY_META
    torch.save({"hyper_parameters": {"color": Color.RED, "out": Path("/runs/a")}}, file)
    with pytest.raises(CheckpointError) as error:
        trusted.load_meta(file)
    assert f"`{Color.__module__}.Color`" in str(error.value) and "`pathlib" not in str(error.value)
    with torch.serialization.safe_globals([Color]):  # what the HINT says to do
        assert trusted.load_meta(file) == {"hyper_parameters": {"color": Color.RED, "out": Path("/runs/a")}}


def test_a_value_torch_itself_allows_reads_back(tmp_path):
    value = io.BytesIO()
    torch.save((0.9, 0.999), value)
    value.seek(0)
    trusted.check_value(value, "optimizer_0.param_groups.0.betas", tmp_path)
    assert value.tell() == 0 and torch.load(value, weights_only=True) == (0.9, 0.999)


def same(loaded: Any, reference: Any) -> bool:
    """Equal the way the file's values are: tensors and arrays by value, omegaconf containers with their caches."""
    from omegaconf import Container, OmegaConf

    if isinstance(reference, torch.Tensor):
        return torch.equal(loaded, reference)
    if isinstance(reference, np.ndarray):
        return np.array_equal(loaded, reference) and loaded.dtype == reference.dtype
    if isinstance(reference, Container):
        return (type(loaded) is type(reference) and loaded == reference
                and OmegaConf.get_cache(loaded) == OmegaConf.get_cache(reference)
                and type(OmegaConf.get_cache(loaded)) is type(OmegaConf.get_cache(reference)))
    if isinstance(reference, dict):
        return type(loaded) is type(reference) and loaded.keys() == reference.keys() and all(
            same(loaded[key], value) for key, value in reference.items())
    if isinstance(reference, (list, tuple)):
        return type(loaded) is type(reference) and len(loaded) == len(reference) and all(
            same(a, b) for a, b in zip(loaded, reference))
    return type(loaded) is type(reference) and loaded == reference


def test_a_lightning_runs_checkpoint_with_hydra_hyperparameters_reads_back_and_resumes(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_nd import NDParallel

    class WithConfig(BoringModel):
        def __init__(self, cfg: Any, out: Path) -> None:
            super().__init__()
            self.save_hyperparameters()

    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "config.yaml").write_text("day: ${now:%Y-%m-%d}\nmodel:\n  layers: [2, 4]\n  dims: {hidden: 64}\n"
                                      "  dropout: null\n  name: ${model.dims.hidden}x\n")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="config")
    assert cfg.day  # resolved, as Hydra resolves `hydra.run.dir`: Hydra's `now` resolver cache is no longer empty

    def trainer(steps: int) -> Trainer:
        return Trainer(strategy=NDParallel(), accelerator="cpu", devices=1, max_steps=steps, logger=False,
                       enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                       callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}")])

    trainer(1).fit(WithConfig(cfg, tmp_path / "out"))
    path = tmp_path / "ckpt" / "step=1.ckpt"
    meta = read_meta(path, files.read_manifest(path))  # format 2: JSON, the config as resolved YAML
    assert meta["hyper_parameters"]["cfg"] == cfg and meta["hyper_parameters"]["cfg"].model.name == "64x"
    assert meta["hyper_parameters"]["out"] == tmp_path / "out"
    resumed = trainer(2)
    resumed.fit(WithConfig(cfg, tmp_path / "out"), ckpt_path=str(path))  # load_sharded: every check on the way
    assert resumed.global_step == 2
    # Format 1 pickled the same state (its config keeps Hydra's `now` cache in a defaultdict): read through the
    # allow-list, equal to what a plain `torch.load` gives.
    legacy, rng = tmp_path / files.LEGACY_META, tmp_path / files.rng_file(0, legacy=True)
    torch.save({"hyper_parameters": {"cfg": cfg, "out": tmp_path / "out"}}, legacy)
    from lightning.fabric.utilities.seed import _collect_rng_states

    torch.save(_collect_rng_states(), rng)
    held = set(torch.serialization.get_unsafe_globals_in_checkpoint(legacy))
    assert {"omegaconf.dictconfig.DictConfig", "collections.defaultdict", "pathlib.PosixPath"} <= held, held
    assert "numpy.ndarray" in set(torch.serialization.get_unsafe_globals_in_checkpoint(rng))
    assert same(trusted.load_meta(legacy), torch.load(legacy, weights_only=False))
    assert same(trusted.load_rng(rng), torch.load(rng, weights_only=False))
    assert trusted.load_meta(legacy)["hyper_parameters"]["cfg"].model.name == "64x"


def test_a_one_file_checkpoint_is_read_as_data_unless_the_caller_trusts_it(tmp_path):
    """``Trainer.fit(ckpt_path="x.ckpt")``: the file is read through the allow-list (an export resumes; a crafted file
    is refused and runs nothing). Lightning 2.6.6 hands a strategy that restores after setup no ``weights_only``
    (``trainer.py``, ``_restore_modules_and_callbacks(ckpt_path)``), so ``None`` is what arrives."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_nd import NDParallel
    from lightning_nd.checkpoint import export

    class Stateful(BoringModel):  # an optimizer with state to carry (plain SGD has none)
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def trainer(steps: int) -> Trainer:
        return Trainer(strategy=NDParallel(), accelerator="cpu", devices=1, max_steps=steps, logger=False,
                       enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                       callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}")])

    trainer(1).fit(Stateful())
    exported = export(tmp_path / "ckpt" / "step=1.ckpt", tmp_path / "export.ckpt", "torch", progress=lambda _: None)
    resumed = trainer(2)
    resumed.fit(Stateful(), ckpt_path=str(exported))
    assert resumed.global_step == 2
    marker, crafted = tmp_path / "ran", tmp_path / "crafted.ckpt"
    torch.save({**torch.load(exported, weights_only=False), "extra": Touches(marker)}, crafted)
    with pytest.raises(CheckpointError, match=r"crafted\.ckpt` holds `.*`, which lightning-nd does not unpickle"):
        trainer(3).fit(Stateful(), ckpt_path=str(crafted))
    assert not marker.exists()
