"""Runs that make one bottleneck real, for the BottleneckMonitor's live tests and the recorded traces in
``tests/data/traces`` (`record_traces`): a loader that sleeps, one rank that sleeps in forward, a pipeline with one
microbatch, a wide tp layout with a tiny batch, a plain run. Every rank runs its part of a real `Trainer.fit`."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from examples.data import SyntheticTokens, TokenDataModule
from examples.lit import CausalLM
from examples.models.llama import DecoderLayer, Llama, LlamaConfig
from lightning_nd import NDParallel


class SlowTokens(SyntheticTokens):
    """A loader that spends ``sleep_s`` per sample (decoding, augmentation, a slow disk)."""

    def __init__(self, *args: Any, sleep_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sleep_s = sleep_s

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(self.sleep_s)
        return super().__getitem__(index)


class Tokens(TokenDataModule):
    def __init__(self, sleep_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sleep_s = sleep_s

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        return DataLoader(SlowTokens(hp.vocab_size, hp.seq_len, hp.num_samples, hp.seed, sleep_s=self.sleep_s),
                          batch_size=hp.batch_size, shuffle=hp.shuffle)


class SleepyLM(CausalLM):
    """``sleepy_rank`` spends ``sleep_s`` more in the forward of its first decoder block, each call (a slower host
    or GPU): once per step, or once per microbatch under pp, whichever stage the rank runs."""

    def __init__(self, sleepy_rank: int | None = None, sleep_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sleepy_rank, self.sleep_s = sleepy_rank, sleep_s

    def on_train_start(self) -> None:
        if self.global_rank == self.sleepy_rank:
            report = self.trainer.strategy.report  # under pp the stages hold the blocks, not this module
            held = [*report.stages] if report is not None and report.stages else [self]
            block = next(m for root in held for m in root.modules() if isinstance(m, DecoderLayer))
            block.register_forward_pre_hook(lambda *_: time.sleep(self.sleep_s) if self.training else None)


def llama(hidden: int = 32, layers: int = 2, experts: int = 0, heads: int = 4) -> Llama:
    return Llama(LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=heads // 2, num_experts=experts))


def monitored(cases: dict[str, dict[str, Any]], folder: str, every: int = 4, steps: int = 8) -> dict[str, Any]:
    """Each case (``layout``, ``model`` (`llama` keywords), ``batch_size``, ``seq_len``, and optionally
    ``loader_sleep_s``, ``sleepy_rank``, ``sleep_s``, ``every`` for its own window) trains ``steps`` steps with a `TroubleshootingView` and a
    `BottleneckMonitor` windowing every ``every`` steps, into ``folder/<case>``; rank 0 returns each case's
    windows (as read back from ``bottleneck.jsonl``) and its TensorBoard folder."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from diagnostics import BottleneckMonitor, TroubleshootingView
    from diagnostics.records import BOTTLENECK_FILE, read_windows

    world, results = int(os.environ["WORLD_SIZE"]), {}
    for name, case in cases.items():
        root = Path(folder) / name
        trainer = Trainer(strategy=NDParallel(**case["layout"]), accelerator="cpu", devices=world, max_steps=steps,
                          callbacks=[TroubleshootingView(), BottleneckMonitor(log_dir=str(root),
                                                                                 every_n_steps=case.get("every", every))],
                          logger=TensorBoardLogger(save_dir=str(root), name="", version=""),
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          limit_val_batches=0, num_sanity_val_steps=0)
        module = SleepyLM(sleepy_rank=case.get("sleepy_rank"), sleep_s=case.get("sleep_s", 0.0), lr=1e-3,
                          model_factory=lambda model=case["model"]: llama(**model))
        batch, seq = case["batch_size"], case["seq_len"]
        trainer.fit(module, datamodule=Tokens(sleep_s=case.get("loader_sleep_s", 0.0), vocab_size=64, seq_len=seq,
                                              num_samples=batch * steps * world, batch_size=batch))
        if trainer.global_rank == 0:
            results[name] = {"windows": read_windows((root / "diagnostics" / BOTTLENECK_FILE).read_text()),
                             "tensorboard": str(root)}
    return results


class _Profile(Callback):
    """Profiles steps ``first`` .. ``first + steps - 1`` with torch's own schedule (ProfilerStep#N markers), as a
    user would, and writes ``rank<R>.json.gz``."""

    def __init__(self, folder: Path, first: int, steps: int) -> None:
        self.folder, self.first, self.steps, self.profiler = folder, first, steps, None

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        def ready(profiler: Any) -> None:
            profiler.export_chrome_trace(str(self.folder / f"rank{trainer.global_rank}.json.gz"))

        schedule = torch.profiler.schedule(wait=self.first - 1, warmup=1, active=self.steps, repeat=1)
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                               on_trace_ready=ready)
        self.profiler.__enter__()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.profiler.step()

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.profiler.__exit__(None, None, None)


def record_traces(folder: str, layout: dict[str, Any], experts: int = 0, sleepy_rank: int | None = None,
                  sleep_s: float = 0.0, loader_sleep_s: float = 0.0, batch_size: int = 2, steps: int = 1) -> dict[str, Any]:
    """``steps`` profiled steps from the third of a tiny Llama under ``layout``: one trace per rank."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ["WORLD_SIZE"])
    trainer = Trainer(strategy=NDParallel(**layout), accelerator="cpu", devices=world, max_steps=5,
                      callbacks=[_Profile(out, first=3, steps=steps)], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      num_sanity_val_steps=0)
    module = SleepyLM(sleepy_rank=sleepy_rank, sleep_s=sleep_s, model_factory=lambda: llama(experts=experts), lr=1e-3)
    trainer.fit(module, datamodule=Tokens(sleep_s=loader_sleep_s, vocab_size=64, seq_len=16, num_samples=256,
                                          batch_size=batch_size))
    if trainer.global_rank == 0:
        (out / "layout.json").write_text(trainer.strategy.layout.to_json(indent=1))
    return {}


TRACE_CASES = {
    "fsdp2_tp2": dict(layout={"dp_shard": 2, "tp": 2}, steps=2),
    "hsdp": dict(layout={"dp_replicate": 2, "dp_shard": 2}),
    "pp2_gpipe": dict(layout={"pp": 2, "dp_shard": 2, "pp_schedule": "gpipe", "pp_microbatches": 1}),
    "cp2_fsdp2": dict(layout={"cp": 2, "dp_shard": 2}),
    "ep2": dict(layout={"dp_shard": 4, "ep": 2}, experts=4),
    "fsdp4_straggler": dict(layout={"dp_shard": 4}, sleepy_rank=3, sleep_s=0.05),
    "fsdp4_slow_loader": dict(layout={"dp_shard": 4}, loader_sleep_s=0.3),
}
"""What ``tests/data/traces/<case>`` holds: 4 ranks each (``python -m tests.distributed.bottleneck_ranks
[case...]`` records them again)."""

if __name__ == "__main__":
    import sys
    import tempfile

    from tests.launcher import launch

    for name in sys.argv[1:] or TRACE_CASES:
        with tempfile.TemporaryDirectory() as logs:
            launch("tests.distributed.bottleneck_ranks:record_traces", 4, Path(logs), timeout=300,
                   folder=str(Path(__file__).parents[1] / "data" / "traces" / name), **TRACE_CASES[name])
        print(f"recorded tests/data/traces/{name}", flush=True)
