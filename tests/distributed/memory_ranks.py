"""Out of memory for real in a 4-rank run with `MemoryMonitor` on, and the measured re-runs its advice is checked
against (`tests/diagnostics/test_memory_live.py`).

The fault: at step ``OOM_STEP`` one rank's second block asks the CPU allocator for 1 PiB inside its forward,
which it refuses ("DefaultCPUAllocator: can't allocate memory"), as a real allocation that does not fit does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from benchmarks.common import PeakMemory
from diagnostics import MemoryMonitor
from examples.data import TokenDataModule
from examples.lit import CausalLM
from examples.models.llama import Llama, LlamaConfig
from lightning_nd import NDParallel

OOM_STEP = 2
TIMEOUT_S = 5
WORLD = int(os.environ.get("WORLD_SIZE", 1))
CONFIG = dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2)
SEQ_LEN, BATCH = 128, 8
LAYOUT = {"dp_replicate": 2, "dp_shard": 2}
TRAINER_KEYS = ("batch_size", "accumulate_grad_batches")


def _trainer(layout: dict[str, Any], **kwargs: Any) -> Trainer:
    assert "RANK" in os.environ, "Trainer.fit runs only inside a launched rank (tests/launcher.py)"
    return Trainer(strategy=NDParallel(**layout, timeout=TIMEOUT_S), accelerator="cpu", devices=WORLD,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   limit_val_batches=0, num_sanity_val_steps=0, **kwargs)


def _data(trainer: Trainer, batch: int, steps: int) -> TokenDataModule:
    replicas = trainer.strategy.dims.batch_size_multiplier
    return TokenDataModule(vocab_size=CONFIG["vocab_size"], seq_len=SEQ_LEN, num_samples=batch * replicas * steps,
                           batch_size=batch)


def oom(victim: int, folder: str, stamp: str, layout: dict[str, int] | None = None, experts: int = 0) -> dict[str, Any]:
    """Train ``layout`` (default ``LAYOUT``) until ``victim`` runs out of memory in step ``OOM_STEP``'s forward; under
    pp inside the pipeline schedule, which wraps the error ("[Stage 0] failed to run forward"); ``experts``: MoE layers
    of that many experts (for ep)."""
    trainer = _trainer(layout or LAYOUT, max_steps=OOM_STEP + 2, callbacks=[MemoryMonitor(log_dir=folder)],
                       logger=TensorBoardLogger(folder, name="tb"))
    train_into_oom(trainer, victim, stamp, experts)
    return {"finished": True}


def train_into_oom(trainer: Trainer, victim: int, stamp: str, experts: int = 0) -> None:
    """Fit the test's model until ``victim``'s second block asks for 1 PiB in step ``OOM_STEP``'s forward (``stamp``
    is written just before)."""
    torch.manual_seed(0)
    module = CausalLM(model=Llama(LlamaConfig(**CONFIG, num_experts=experts)), lr=1e-3)

    def allocate(block: torch.nn.Module, args: Any) -> None:
        if trainer.global_rank == victim and trainer.global_step == OOM_STEP and block.training:
            Path(stamp).write_text("now")
            torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the allocator refuses it

    module.model.layers[1].register_forward_pre_hook(allocate)
    trainer.fit(module, datamodule=_data(trainer, BATCH, OOM_STEP + 2))


def measure(changes: list[dict[str, Any]]) -> list[int]:
    """The highest rank's measured peak (torch's `MemTracker`, a steady-state step) of ``LAYOUT`` with each
    change applied: `NDParallel` keywords, and ``batch_size`` / ``accumulate_grad_batches`` for the Trainer."""
    peaks = []
    for change in changes:
        layout = {**LAYOUT, **{k: v for k, v in change.items() if k not in TRAINER_KEYS}}
        accumulate = change.get("accumulate_grad_batches", 1)
        probe = PeakMemory(step=2 * accumulate - 1)  # the second optimizer step's last micro-batch
        trainer = _trainer(layout, max_steps=2, accumulate_grad_batches=accumulate, callbacks=[probe], logger=False)
        torch.manual_seed(0)
        module = CausalLM(model=Llama(LlamaConfig(**CONFIG)), lr=1e-3)
        trainer.fit(module, datamodule=_data(trainer, change.get("batch_size", BATCH), 2 * accumulate))
        peak = torch.tensor([probe.peak_bytes])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peaks.append(int(peak))
    return peaks
