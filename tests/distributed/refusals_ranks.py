"""Models that would train wrong, silently, under a dim: each `Trainer.fit` must stop before its first optimizer
step with a HINT. Run on every rank of a 2-rank launch (see test_refusals.py)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from torch import nn

from examples.data import TokenDataModule
from examples.lit import CausalLM
from lightning_nd import NDParallel
from tests.models import VOCAB
from tests.unit.bad_models import LearnedPositions, batch_norm_net


class PooledClassifier(nn.Module):
    """Takes `position_ids` (so the plan passes it), then classifies the mean over the sequence."""

    def __init__(self, hidden: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, hidden), nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens)[:, :, None].transpose(1, 2)  # [batch, 1 head, seq, hidden]
        x = F.scaled_dot_product_attention(x, x, x, is_causal=True).squeeze(1)
        return self.head(x.mean(1))


class SequenceClassifier(CausalLM):
    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(self.model(batch["tokens"]), batch["labels"][:, 0] % 3)


class Steps(Callback):
    def __init__(self) -> None:
        self.count = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.count += 1


def _refused(layout: dict[str, Any], module: CausalLM) -> dict[str, Any]:
    """One Trainer.fit that must be refused; only in ranks started by tests.launcher, never inside pytest."""
    assert "RANK" in os.environ, "run by tests.launcher in its own processes, never inside pytest"
    steps = Steps()
    trainer = Trainer(strategy=NDParallel(**layout), accelerator="cpu", devices=2, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0, callbacks=[steps])
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    try:
        trainer.fit(module, datamodule=TokenDataModule(vocab_size=VOCAB, seq_len=16, num_samples=16, batch_size=2))
        message = "no error"
    except ValueError as error:
        message = str(error)
    after = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
             for name, p in module.named_parameters()}
    return {"message": message, "optimizer_steps": steps.count, "global_step": trainer.global_step,
            "unchanged": all(torch.equal(before[name], after[name]) for name in before)}


SCENARIOS = {
    "cp_learned_positions": lambda: _refused({"cp": 2, "dp_shard": 1}, CausalLM(model=LearnedPositions(VOCAB))),
    "cp_pooling": lambda: _refused({"cp": 2, "dp_shard": 1}, SequenceClassifier(model=PooledClassifier())),
    "batch_norm_dp_shard": lambda: _refused({"dp_shard": 2}, CausalLM(model=nn.Sequential(
        nn.Embedding(VOCAB, 16), batch_norm_net(), nn.Linear(16, VOCAB)))),
}


def run_all() -> dict[str, Any]:
    assert "RANK" in os.environ, "run by tests.launcher in its own processes, never inside pytest"
    results = {}
    for name, scenario in SCENARIOS.items():
        torch.manual_seed(0)  # every rank builds the same model, so "unchanged" compares like with like
        results[name] = scenario()
    return results
