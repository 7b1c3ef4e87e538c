"""A checkpoint written before the Layout change (lightning-nd at commit 8163579: 2 ranks, tp=2, weights only,
2 AdamW steps; `tests/data/checkpoint_before_layout/`) still loads: read whole in one process, exported to one
file, and through `Trainer.validate(ckpt_path=...)` under `NDParallel`; the logits equal those its run saved."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch import Trainer

from examples.data import TokenDataModule
from examples.lit import CausalLM
from lightning_nd import NDParallel
from lightning_nd.checkpoint import export, read_sharded
from lightning_nd.checkpoint.export import read_export
from tests.models import VOCAB, build

SAVED = Path(__file__).resolve().parents[1] / "data" / "checkpoint_before_layout"


def _expected() -> dict[str, torch.Tensor]:
    return torch.load(SAVED / "expected_logits.pt")


def test_read_whole_and_exported_into_a_plain_model(tmp_path):
    expected = _expected()
    state = read_sharded(SAVED / "step=2.ckpt")["state_dict"]
    model = build("llama")
    model.load_state_dict({name.removeprefix("model."): tensor for name, tensor in state.items()})
    with torch.no_grad():
        torch.testing.assert_close(model(expected["tokens"]), expected["logits"], rtol=1e-6, atol=1e-6)
    exported = export(SAVED / "step=2.ckpt", tmp_path / "export.ckpt")  # torch, by its suffix
    assert set(torch.load(exported, weights_only=False)["state_dict"]) == set(state)
    assert set(read_export(export(SAVED / "step=2.ckpt", tmp_path / "export.safetensors"))["state_dict"]) == set(state)


def test_loads_through_the_strategy_in_one_process():
    expected = _expected()
    trainer = Trainer(strategy=NDParallel(), accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=1)
    module = CausalLM(model=build("llama", seed=1), lr=1e-3)
    data = TokenDataModule(vocab_size=VOCAB, seq_len=16, num_samples=4, batch_size=4)
    try:
        trainer.validate(module, datamodule=data, ckpt_path=str(SAVED / "step=2.ckpt"), verbose=False)
    finally:  # the one-process group Lightning started stays up otherwise, for every later test of this process
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    with torch.no_grad():
        torch.testing.assert_close(module(expected["tokens"]), expected["logits"], rtol=1e-6, atol=1e-6)
