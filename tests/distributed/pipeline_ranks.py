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


def tied_checkpoint(ckpt_dir: str, export_to: str, base: dict, layouts: dict[str, dict]) -> dict:
    """A GPT with tied embeddings trained 8 steps on ``base``, saving at step 3; resumed from step 3 on the same
    layout to step 8, and on each of ``layouts`` (``full_*`` from a one-file export) for two steps. Rank 0 also
    returns the names the checkpoint holds."""
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemReader

    from lightning_nd.checkpoint import export
    from tests.distributed.checkpoint_ranks import SAVE_EVERY, STEPS, fit

    results = {"uninterrupted": fit(base, STEPS, ckpt_dir=ckpt_dir, model="gpt4")}
    step3 = Path(ckpt_dir) / f"step={SAVE_EVERY}.ckpt"
    results["same_layout"] = fit(base, STEPS, ckpt_path=str(step3), seed=1, model="gpt4")
    if dist.get_rank() == 0:
        export(step3, Path(export_to))
        results["saved_keys"] = sorted(FileSystemReader(step3).read_metadata().state_dict_metadata)
    dist.barrier()
    for name, layout in layouts.items():
        source = export_to if name.startswith("full_") else str(step3)
        results[name] = fit(layout, SAVE_EVERY + 2, ckpt_path=source, seed=1, model="gpt4")
    results["on_meta"] = _tied_on_meta(base)
    return results


def _tied_on_meta(layout: dict) -> dict:
    """The model built on the meta device (`configure_model`), each rank materialising its own stages: the tied
    weight's copies when training starts and after two steps."""
    from tests.distributed.checkpoint_ranks import WORLD, StateAt

    state = StateAt()
    trainer = Trainer(strategy=NDParallel(**layout), accelerator="cpu", devices=WORLD,
                      max_steps=2, callbacks=[state], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    module = CausalLM(model_factory=lambda: build("gpt4"), lr=1e-3)
    trainer.fit(module, datamodule=TokenDataModule(vocab_size=VOCAB, seq_len=SEQ_LEN, num_samples=16, batch_size=4))
    return {"loaded": state.loaded, "final": StateAt._params(module)}
