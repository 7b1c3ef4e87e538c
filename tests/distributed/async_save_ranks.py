"""Asynchronous saves, run on every rank (`test_async_save.py`): the same training with synchronous and asynchronous
saves at every step; with `ModelCheckpoint(save_top_k=1, save_last="link")`, what is on disk whenever an older
checkpoint is asked to go and when it goes; a rank SIGKILLed while its asynchronous save is being committed.

The asynchronous runs write slowly (`SlowWriter` waits before DCP writes), so training steps, later saves and
removals happen while a write is in flight: a staged copy that still shared memory with the parameters, or a
removal that did not wait for the commit, would show.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.data import TokenDataModule
from examples.lit import CausalLM
from lightning_nd import NDParallel
from lightning_nd.checkpoint import files
from tests.distributed.checkpoint_ranks import FAST_FAILURE, StateAt
from tests.distributed.parity_ranks import LossRecorder
from tests.models import VOCAB, build

SEQ_LEN, GLOBAL_BATCH, STEPS = 16, 8, 5
WRITE_DELAY_S = 0.4
WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # read at import: Lightning's teardown unsets it


class SlowWriter(dcp.FileSystemWriter):
    def write_data(self, plan: Any, planner: Any) -> Any:
        time.sleep(WRITE_DELAY_S)  # in DCP's background thread: the loop trains on meanwhile
        return super().write_data(plan, planner)


@contextmanager
def slow_writes():
    original = dcp.FileSystemWriter
    dcp.FileSystemWriter = SlowWriter
    try:
        yield
    finally:
        dcp.FileSystemWriter = original


class Saves(Callback):
    """The checkpoint events; on rank 0, what the folder holds when `ModelCheckpoint` asks for an older checkpoint's
    removal and when it is removed: the complete checkpoints (by step) and whether ``last.ckpt`` names a whole one."""

    def __init__(self, folder: str) -> None:
        self.folder, self.saved, self.committed, self.removals = Path(folder), [], [], []

    def on_nd_checkpoint_saved(self, strategy, event) -> None:
        self.saved.append((event.step, event.committed, event.seconds))

    def on_nd_checkpoint_committed(self, strategy, event) -> None:
        self.committed.append((event.step, event.seconds))

    def on_fit_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        if not trainer.is_global_zero:
            return
        asked, remove = strategy.remove_checkpoint, strategy.checkpoint_io.remove_checkpoint
        strategy.remove_checkpoint = lambda path: (self._note("asked", path), asked(path))[-1]
        strategy.checkpoint_io.remove_checkpoint = lambda path: (self._note("removed", path), remove(path))[-1]

    def _note(self, what: str, path: str) -> None:
        complete = sorted(int(p.name[5:-5]) for p in self.folder.glob("step=*.ckpt") if files.is_complete(p))
        link = self.folder / "last.ckpt"
        self.removals.append({"what": what, "step": int(Path(path).name[5:-5]), "complete": complete,
                              "link_whole": files.is_complete(link) if link.resolve().exists() else None})


def fit(layout: dict[str, Any], ckpt_dir: str, async_save: bool, top_k: int = -1, callbacks: list[Callback] = (),
        **strategy: Any) -> dict[str, Any]:
    """``STEPS`` steps saving at every one; losses, whole parameters at the end, what `Saves` saw."""
    recorder, state, saves = LossRecorder(), StateAt(step=STEPS), Saves(ckpt_dir)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=top_k, save_last="link",
                                 filename="{step}")
    trainer = Trainer(
        strategy=NDParallel(**layout, async_save=async_save, **strategy), accelerator="cpu", devices=WORLD,
        max_steps=STEPS, callbacks=[recorder, state, saves, checkpoint, *callbacks], logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    dp = trainer.strategy.dims.batch_size_multiplier
    data = TokenDataModule(vocab_size=VOCAB, seq_len=SEQ_LEN, num_samples=GLOBAL_BATCH * STEPS,
                           batch_size=GLOBAL_BATCH // dp)
    trainer.fit(CausalLM(model=build("llama", 0), lr=1e-3), datamodule=data)
    return {"losses": recorder.losses, "after": state.after, "saved": saves.saved, "committed": saves.committed,
            "removals": saves.removals}


def sync_and_async(root: str, layout: dict[str, Any], top_k_run: bool) -> dict[str, Any]:
    """The same training with synchronous saves, with slow asynchronous ones (every checkpoint kept), and with
    ``top_k_run`` slow asynchronous ones under ``save_top_k=1``."""
    results = {"sync": fit(layout, f"{root}/sync", async_save=False)}
    with slow_writes():
        results["async"] = fit(layout, f"{root}/async", async_save=True)
        if top_k_run:
            results["top1"] = fit(layout, f"{root}/top1", async_save=True, top_k=1)
    return results


class DieWhileCommitting(Callback):
    """Rank ``rank`` SIGKILLs itself in the commit thread of step ``step``'s save: its own write is done, the
    checkpoint is not yet committed; the time of death goes to ``stamp``."""

    def __init__(self, rank: int, step: int, stamp: str) -> None:
        self.rank, self.step, self.stamp = rank, step, stamp

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.global_rank != self.rank:
            return
        own_files = files.own_files

        def dying(folder: Path, writer: int) -> dict[str, dict[str, int]]:
            if folder.name.startswith(f".step={self.step}.ckpt.") and folder.name.endswith(".partial"):
                Path(self.stamp).write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return own_files(folder, writer)

        files.own_files = dying


def die_while_committing(ckpt_dir: str, stamp: str, rank: int, step: int) -> dict[str, Any]:
    with slow_writes():
        return fit({"dp_shard": WORLD}, ckpt_dir, async_save=True, top_k=1,
                   callbacks=[DieWhileCommitting(rank, step, stamp)], **FAST_FAILURE)
