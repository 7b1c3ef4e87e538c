"""Runs on every rank of a 4-rank launch: the strategy's events, heard by a Trainer callback, in real runs.

Fits, in one process group: pp=2 x cp=2 (phases per microbatch, the schedule's and ring attention's
point-to-point operations, stage timings, groups, layout, checkpoints saved), its checkpoint resumed under
dp_shard=4 (loaded, resharded), ep=2 x dp_shard=4 on the MoE Llama (routing
counts), a slow first step on one rank under a 2 s step timeout (the switch to the short timeout waits for
every rank), and last an out-of-memory error raised in every rank's forward (the OOM event and the verdict
come before the error leaves `fit`; the process carries on).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.data import TokenDataModule
from examples.lit import CausalLM
from lightning_nd import NDParallel
from lightning_nd.strategy.events import ALL_EVENTS, LayoutReady
from tests.distributed.parity_ranks import LossRecorder
from tests.models import VOCAB, build

WORLD = int(os.environ.get("WORLD_SIZE", 1))


class EventLog(Callback):
    """Every event, one JSON line each, flushed as it comes (a rank that exits leaves what it heard)."""

    def __init__(self, path: str) -> None:
        self.path = path
        for event in ALL_EVENTS:
            setattr(self, event.hook, self._hear)

    def _hear(self, strategy: Any, event: Any) -> None:
        record = {"event": type(event).__name__, "initialized": dist.is_initialized()}
        record.update({k: v for k, v in asdict(event).items() if k != "layout"} if not isinstance(event, LayoutReady)
                      else {"roles": event.layout.roles, "techniques": [t.technique for t in event.layout.techniques]})
        with open(self.path, "a") as log:
            log.write(json.dumps(record, default=str) + "\n")


class SlowFirstStep(Callback):
    """Rank ``rank`` takes ``seconds`` longer over its first optimizer step than the others."""

    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0 and trainer.global_rank == self.rank:
            time.sleep(self.seconds)


class OutOfMemoryAt(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")


def _fit(name: str, out_dir: str, layout: dict[str, Any], model: str = "llama", steps: int = 2,
         callbacks: tuple = (), ckpt: bool = False, ckpt_path: str | None = None, **strategy: Any) -> dict[str, Any]:
    recorder = LossRecorder()
    path = str(Path(out_dir) / f"{name}-rank{dist.get_rank() if dist.is_initialized() else os.environ['RANK']}.jsonl")
    saving = [ModelCheckpoint(dirpath=str(Path(out_dir) / f"ckpt-{name}"), every_n_train_steps=1, save_top_k=-1,
                              filename="{step}")] if ckpt else []
    trainer = Trainer(strategy=NDParallel(**layout, **strategy), accelerator="cpu", devices=WORLD, max_steps=steps,
                      callbacks=[recorder, EventLog(path), *saving, *callbacks], logger=False,
                      enable_checkpointing=ckpt, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0)
    batch_ranks = trainer.strategy.dims.batch_size_multiplier
    data = TokenDataModule(vocab_size=VOCAB, seq_len=16, num_samples=8 * steps, batch_size=8 // batch_ranks)
    trainer.fit(CausalLM(model=build(model), lr=1e-3), datamodule=data, ckpt_path=ckpt_path)
    return {"losses": recorder.losses, "events": path}


def run_all(folder: str) -> dict[str, Any]:
    results = {
        "pp_cp": _fit("pp_cp", folder, {"pp": 2, "cp": 2, "dp_shard": 1}, ckpt=True),
        "resumed": _fit("resumed", folder, {"dp_shard": 4}, steps=3,
                        ckpt_path=str(Path(folder) / "ckpt-pp_cp" / "step=2.ckpt")),
        "moe": _fit("moe", folder, {"ep": 2, "dp_shard": 4}, model="moe_llama"),
        "slow_first_step": _fit("slow_first_step", folder, {"dp_shard": 4}, steps=3,
                                callbacks=(SlowFirstStep(rank=1, seconds=5.0),), timeout=2, heartbeat_timeout=None),
    }
    try:
        _fit("oom", folder, {"dp_shard": 4}, steps=3, callbacks=(OutOfMemoryAt(),))
    except torch.OutOfMemoryError as error:
        results["oom"] = {"raised": str(error), "events": str(Path(folder) / f"oom-rank{dist.get_rank()}.jsonl")}
    return results
