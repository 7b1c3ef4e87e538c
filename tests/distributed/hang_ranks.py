"""Faults injected for real into 4-rank runs with `CollectiveMonitor` on (`tests/diagnostics/test_hang_live.py`).

Each fault comes in step ``FAULT_STEP`` (after the first optimizer step, so under the short ``timeout``), or with
``epoch_steps`` (every step also an epoch boundary: one batch per rank per epoch) in step ``EPOCH_FAULT_STEP``; the
heartbeat timeout keeps its default (60 s): the run must still stop within ``timeout`` + 30 s.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from diagnostics import CollectiveMonitor, RunSummary
from examples.data import TokenDataModule
from examples.lit import CausalLM
from lightning_nd import NDParallel
from tests.models import VOCAB, build

FAULT_STEP = 2
EPOCH_FAULT_STEP = 3
TIMEOUT_S = 5
WORLD = int(os.environ.get("WORLD_SIZE", 1))


class FaultyLM(CausalLM):
    """A CausalLM whose training step misbehaves on one rank at one step, the way real code does."""

    def __init__(self, fault: str, victim: int, stamp: str, fault_step: int = FAULT_STEP, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fault, self.victim, self.stamp, self.fault_step = fault, victim, stamp, fault_step
        self.faulted = False

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == self.fault_step and not self.faulted:  # every stage runs this hook, under pp too
            self.faulted = True
            self.misbehave()

    def misbehave(self) -> None:
        rank = self.global_rank
        if rank == self.victim and self.fault != "never_send":
            Path(self.stamp).write_text(str(time.time()))
        if self.fault == "skip":  # every rank syncs two values over dp_shard; the victim skips the first
            group = self.device_mesh.group("dp_shard")
            if rank != self.victim:
                dist.all_reduce(torch.ones(4), group=group)
            dist.all_reduce(torch.ones(4), group=group)
        elif self.fault == "size":  # the victim's value has another length
            dist.all_reduce(torch.ones(8 if rank == self.victim else 4), group=self.device_mesh.group("tp"))
        elif self.fault == "stuck" and rank == self.victim:
            time.sleep(600)
        elif self.fault == "kill" and rank == self.victim:
            os.kill(os.getpid(), signal.SIGKILL)


def never_send(victim: int, stamp: str, stage_chunk: int = 0) -> None:
    """On ``victim`` (a pipeline stage), the forward send of microbatch ``stage_chunk`` in step FAULT_STEP is
    never issued: its neighbour waits for activations that never come."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    original = _PipelineStageBase.get_fwd_send_ops
    steps = {"count": 0}

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        ops = original(self, fwd_chunk_id)
        if fwd_chunk_id == 0:
            steps["count"] += 1
        if dist.get_rank() == victim and steps["count"] == FAULT_STEP + 1 and fwd_chunk_id == stage_chunk:
            Path(stamp).write_text(str(time.time()))
            return []
        return ops

    _PipelineStageBase.get_fwd_send_ops = get_fwd_send_ops


def run(fault: str, layout: dict[str, Any], victim: int, folder: str, stamp: str, tensorboard: bool = False,
        model: str = "llama", epoch_steps: bool = False) -> dict[str, Any]:
    """``tensorboard``: log there (the cards are read back); off elsewhere, importing it costs each rank a second.
    ``model``: one of `tests.models` (``moe_llama`` for ep); ``epoch_steps``: one batch per rank per epoch."""
    if fault == "never_send":
        never_send(victim, stamp)
    monitor = CollectiveMonitor(log_dir=folder)
    trainer = Trainer(
        strategy=NDParallel(**layout, timeout=TIMEOUT_S), accelerator="cpu", devices=WORLD, max_steps=6,
        callbacks=[monitor, RunSummary(log_dir=folder)],
        logger=TensorBoardLogger(folder, name="tb") if tensorboard else False,
        enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    dp = trainer.strategy.dims.batch_size_multiplier
    data = TokenDataModule(vocab_size=VOCAB, seq_len=16, num_samples=8 if epoch_steps else 64, batch_size=8 // dp)
    module = FaultyLM(fault, victim, stamp, EPOCH_FAULT_STEP if epoch_steps else FAULT_STEP, model=build(model, 0),
                      lr=1e-3)
    trainer.fit(module, datamodule=data)
    return {"finished": True}
