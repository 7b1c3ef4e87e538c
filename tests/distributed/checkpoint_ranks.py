"""Checkpoint scenarios run on every rank: train with checkpoints, resume on the same and on other
layouts, load one-file exports, and die on purpose (`test_checkpoint.py`, `test_failures.py`).

One epoch is 4 steps of 8 samples; the checkpoints at steps 3 and 6 are mid-epoch (epochs 0 and 1), so
resuming from them must skip the batches already trained, in that epoch's sampler order.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.data import TokenDataModule
from examples.lit import CausalLM
from lightning_nd import NDParallel
from lightning_nd.pipeline_parallel.stage import PipelineStages
from tests.distributed.parity_ranks import LossRecorder
from tests.models import VOCAB, build

SEQ_LEN = 16
GLOBAL_BATCH = 8
STEPS_PER_EPOCH = 4
STEPS = 8
SAVE_EVERY = 3
WORLD = int(os.environ.get("WORLD_SIZE", 1))  # read at import: Lightning's teardown unsets it


class StateAt(Callback):
    """Whole parameters (whole-model names) when training starts (what was loaded) and after step ``step``;
    a number drawn from the global RNG in every step (as dropout would)."""

    def __init__(self, step: int | None = None) -> None:
        self.step, self.loaded, self.after, self.draws = step, {}, {}, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.draws[trainer.global_step + 1] = torch.rand(()).item()

    @staticmethod
    def _params(module) -> dict[str, torch.Tensor]:
        return {PipelineStages.original_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in module.model.named_parameters()}

    def on_train_start(self, trainer, pl_module) -> None:
        self.loaded = self._params(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.after = self._params(pl_module)


class DieAt(Callback):
    """SIGKILL rank ``rank`` as step ``step`` starts; the time of death goes to ``stamp``."""

    def __init__(self, rank: int, step: int, stamp: str) -> None:
        self.rank, self.step, self.stamp = rank, step, stamp

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            Path(self.stamp).write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


def fit(layout: dict[str, Any], max_steps: int, ckpt_dir: str | None = None, ckpt_path: str | None = None,
        callbacks: list[Callback] = (), seed: int = 0, every: int = SAVE_EVERY, model: str = "llama",
        save_to: str | None = None, **strategy: Any) -> dict[str, Any]:
    recorder, state = LossRecorder(), StateAt(step=SAVE_EVERY)
    checkpoints = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every,
                                   save_top_k=-1, save_last="link", filename="{step}")] if ckpt_dir else []
    trainer = Trainer(
        strategy=NDParallel(**layout, **strategy), accelerator="cpu", devices=WORLD, max_steps=max_steps,
        callbacks=[recorder, state, *checkpoints, *callbacks], logger=False, enable_checkpointing=bool(ckpt_dir),
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    dp = trainer.strategy.dims.batch_size_multiplier
    data = TokenDataModule(vocab_size=VOCAB, seq_len=SEQ_LEN, num_samples=GLOBAL_BATCH * STEPS_PER_EPOCH,
                           batch_size=GLOBAL_BATCH // dp)
    module = CausalLM(model=build(model, seed), lr=1e-3)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    if save_to:
        trainer.save_checkpoint(save_to)
    return {"losses": recorder.losses, "loaded": state.loaded, "after": state.after, "draws": state.draws,
            "epoch": trainer.current_epoch, "step": trainer.global_step}


def resume_and_reshard(ckpt_dir: str, base: dict[str, Any], layouts: dict[str, dict[str, Any]], export_to: str,
                       model: str = "llama") -> dict[str, Any]:
    """Train 8 steps on ``base`` saving at 3 and 6; resume on the same layout from each to step 8, and from
    step 3 on each of ``layouts`` (from the folder, and ``full_*`` from a one-file safetensors export) for one step;
    ``export_to`` also gets the torch export."""
    from lightning_nd.checkpoint import export

    results = {"uninterrupted": fit(base, STEPS, ckpt_dir=ckpt_dir, model=model)}
    step3 = str(Path(ckpt_dir) / f"step={SAVE_EVERY}.ckpt")
    results["same_layout"] = fit(base, STEPS, ckpt_path=step3, seed=1, model=model)
    step6 = str(Path(ckpt_dir) / f"step={2 * SAVE_EVERY}.ckpt")
    results["same_layout_epoch1"] = fit(base, STEPS, ckpt_path=step6, seed=1, model=model)
    code_free = str(Path(export_to).with_suffix(".safetensors"))  # the same state, without a pickle
    if dist.get_rank() == 0:
        export(Path(step3), Path(export_to))
        export(Path(step3), Path(code_free))
    dist.barrier()
    for name, layout in layouts.items():
        source = code_free if name.startswith("full_") else step3
        save_to = str(Path(ckpt_dir) / f"{name}.ckpt") if name.startswith("pp") else None  # a pipeline's own save
        results[name] = fit(layout, SAVE_EVERY + 1, ckpt_path=source, seed=1, model=model, save_to=save_to)
    return results


def probe_tokens() -> torch.Tensor:
    return torch.randint(VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(7))


def one_process(sharded: str, full: str, truncated: str) -> dict[str, Any]:
    """One process under NDParallel: logits on the probe after loading the folder and the one-file export;
    training resumed from the folder (model and optimizer); the error loading a truncated copy."""
    from lightning_nd.checkpoint import CheckpointError

    result = {"sharded": logits_after_loading(sharded), "full": logits_after_loading(full),
              "resumed": fit({}, SAVE_EVERY + 1, ckpt_path=sharded, seed=1)}
    try:
        logits_after_loading(truncated)
    except CheckpointError as error:
        result["truncated_error"] = str(error)
    return result


def logits_after_loading(ckpt_path: str) -> torch.Tensor:
    """Load ``ckpt_path`` through `Trainer.validate` under NDParallel, return the logits on the probe."""
    trainer = Trainer(strategy=NDParallel(), accelerator="cpu", devices=WORLD, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=1)
    data = TokenDataModule(vocab_size=VOCAB, seq_len=SEQ_LEN, num_samples=GLOBAL_BATCH, batch_size=GLOBAL_BATCH)
    torch.manual_seed(1)
    module = CausalLM(model=build("llama"), lr=1e-3)
    trainer.validate(module, datamodule=data, ckpt_path=ckpt_path, verbose=False)
    with torch.no_grad():
        return module(probe_tokens())


FAST_FAILURE = {"heartbeat_timeout": 6, "timeout": 30}  # seconds; the test allows timeout + 30 s


def die_mid_step(ckpt_dir: str, stamp: str, rank: int, step: int) -> dict[str, Any]:
    """4 ranks, a checkpoint every step; ``rank`` is SIGKILLed as step ``step + 1`` starts. Every rank's events go
    to ``events-rank<r>.jsonl`` beside ``stamp``."""
    from tests.distributed.events_ranks import EventLog

    events = EventLog(str(Path(stamp).parent / f"events-rank{os.environ['RANK']}.jsonl"))
    return fit({"dp_shard": 4}, STEPS, ckpt_dir=ckpt_dir, every=1, callbacks=[DieAt(rank, step, stamp), events],
               **FAST_FAILURE)


def die_mid_save(ckpt_dir: str, stamp: str, rank: int, step: int) -> dict[str, Any]:
    """4 ranks, a checkpoint every step; ``rank`` is SIGKILLed after writing its shards of step ``step``,
    before the checkpoint is committed."""
    from lightning_nd.checkpoint import files

    own_files = files.own_files

    def dying(folder: Path, writer: int) -> dict[str, dict[str, int]]:
        if writer == rank and folder.name.startswith(f".step={step}.ckpt.") and folder.name.endswith(".partial"):
            Path(stamp).write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return own_files(folder, writer)

    files.own_files = dying
    return fit({"dp_shard": 4}, STEPS, ckpt_dir=ckpt_dir, every=1, **FAST_FAILURE)


def resume_last(ckpt_dir: str, fresh_dir: str) -> dict[str, Any]:
    """Resume from ``last`` in ``ckpt_dir`` to the end; and the same run uninterrupted, for comparison."""
    return {"resumed": fit({"dp_shard": 4}, STEPS, ckpt_dir=ckpt_dir, ckpt_path="last", every=1, seed=1),
            "uninterrupted": fit({"dp_shard": 4}, STEPS, ckpt_dir=fresh_dir, every=1)}
