"""A checkpoint lightning-nd wrote at db1c3e6, format 1 (`tests/data/checkpoint_db1c3e6/`: 2 ranks, dp_shard=2, a
tiny MLP, AdamW, 3 steps, an omegaconf config and a path in the hyper-parameters) still reads and resumes: whole in
one process with its weights and hyper-parameters, and under `NDParallel` from its step (in a process of its own)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nd import NDParallel
from lightning_nd.checkpoint import files, read_sharded
from tests.launcher import launch

SAVED = Path(__file__).resolve().parents[1] / "data" / "checkpoint_db1c3e6"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Tiny(LightningModule):
    """The module that wrote it (`SOURCES.md`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Loaded(Callback):
    def on_train_start(self, trainer, module) -> None:
        self.weights = {name: param.detach().clone() for name, param in module.named_parameters()}


def test_it_reads_whole_with_its_weights_and_hyper_parameters():
    expected = torch.load(SAVED / "expected.pt")
    assert files.read_manifest(SAVED / "step=3.ckpt")["format"] == 1
    whole = read_sharded(SAVED / "step=3.ckpt", progress=lambda _: None)
    assert whole["global_step"] == expected["global_step"] == 3
    for name, value in expected["weights"].items():
        assert torch.equal(whole["state_dict"][name], value), name
    assert whole["hyper_parameters"]["cfg"].name == "16x" and isinstance(whole["hyper_parameters"]["out"], Path)
    assert set(whole["optimizer_states"][0]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def resume_from_it() -> dict:
    """In a process of its own (`tests.launcher`): NDParallel resumes from the folder and trains one step more."""
    loaded = Loaded()
    trainer = Trainer(strategy=NDParallel(), accelerator="cpu", devices=1, max_steps=4, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[loaded])
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 8, generator=generator), torch.randint(0, 4, (32,), generator=generator))
    trainer.fit(Tiny(), DataLoader(data, batch_size=4), ckpt_path=str(SAVED / "step=3.ckpt"))
    return {"global_step": trainer.global_step, "weights": loaded.weights}


def test_it_resumes_under_ndparallel_from_its_step(tmp_path):
    (resumed,) = launch("tests.unit.test_db1c3e6_checkpoint:resume_from_it", 1, tmp_path, timeout=120)
    assert resumed["global_step"] == 4
    for name, value in torch.load(SAVED / "expected.pt")["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name
