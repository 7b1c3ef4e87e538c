"""Pipeline scenarios beyond the parity layouts, run on every rank (tests/distributed/test_pipeline.py)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from examples.data import SyntheticTokens, TokenDataModule
from examples.lit import CausalLM
from lightning_nd import NDParallel
from tests.models import VOCAB, build

SEQ_LEN = 16


def short_last_batch() -> dict:
    """12 samples in batches of 8: the second batch (4 samples) has other shapes than the first, so the
    stages between ranks are sized again. Returns the per-step losses of the pipeline and of one process."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # a tests.launcher rank, never pytest
    trainer = Trainer(strategy=NDParallel(pp=world, dp_shard=1), accelerator="cpu", devices=world, max_epochs=1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0)
    losses: list[float] = []
    module = CausalLM(model=build("llama8"), lr=1e-3)
    module.on_train_batch_end = lambda outputs, batch, batch_idx: losses.append(float(outputs["loss"]))
    trainer.fit(module, datamodule=TokenDataModule(vocab_size=VOCAB, seq_len=SEQ_LEN, num_samples=12, batch_size=8))
    if rank != 0:
        return {"losses": losses}
    model = build("llama8")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    dataset = SyntheticTokens(VOCAB, SEQ_LEN, 12)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0)).tolist()
    expected = []
    for batch in DataLoader(dataset, batch_size=8, sampler=order):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch["tokens"]).flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    return {"losses": losses, "expected": expected}
