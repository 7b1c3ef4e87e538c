"""Measured pipeline idle fraction per schedule next to the theoretical bubble, on 2 CPU processes.

    python benchmarks/pipeline_bubble.py

Each schedule trains a Llama-style model of 8 equal blocks (a small vocabulary, so the head adds
~3% to the last stage and the stages stay balanced; wide enough that a microbatch's compute dwarfs
sending its activations) under `NDParallel(pp=2, dp_shard=1)` for a few steps. A rank's idle fraction = 1 - (time inside its stages' forward/backward) / (step time), from
`NDParallel.pipeline_timings`; the table gives its mean over the 2 ranks and the steps after the
first two (warm-up, shape inference). Theory: (p-1)/(m+p-1) for one stage per rank, (p-1)/(v*m+p-1)
with v stages per rank (the zero-bubble schedules aim lower still by splitting backward). pp=2
because this machine has 2 cores: with more ranks than cores the ranks would wait on the CPU, not
on each other.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.launch import run_on_ranks  # noqa: E402

PP = 2
STEPS, WARMUP = 5, 2
MICROBATCH, SEQ_LEN = 2, 128
CONFIG = dict(vocab_size=256, hidden_size=384, intermediate_size=1152, num_hidden_layers=8, num_attention_heads=6,
              num_key_value_heads=2)


class IdleFraction(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(trainer.strategy.pipeline_timings["idle_fraction"])


def measure(schedule: str, microbatches: int) -> float:
    from examples.data import TokenDataModule
    from examples.lit import CausalLM
    from examples.models.llama import Llama, LlamaConfig
    from lightning_nd import NDParallel

    probe = IdleFraction()
    trainer = Trainer(strategy=NDParallel(pp=PP, dp_shard=1, pp_schedule=schedule, pp_microbatches=microbatches),
                      accelerator="cpu", devices=PP, max_steps=STEPS, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[probe])
    batch = MICROBATCH * microbatches
    data = TokenDataModule(vocab_size=CONFIG["vocab_size"], seq_len=SEQ_LEN, num_samples=batch * STEPS,
                           batch_size=batch)
    torch.manual_seed(0)
    trainer.fit(CausalLM(model=Llama(LlamaConfig(**CONFIG))), datamodule=data)
    mine = torch.tensor(statistics.mean(probe.values[WARMUP:]))
    dist.all_reduce(mine)
    return mine.item() / PP


def main() -> None:
    from lightning_nd.pipeline_parallel.schedules import SCHEDULES, check_schedule, theoretical_bubble

    rows = []
    for microbatches in (4, 8):
        for schedule in SCHEDULES:
            stages_per_rank, _ = check_schedule(schedule, PP, None, microbatches)
            theory = theoretical_bubble(schedule, PP, microbatches, stages_per_rank)
            rows.append((schedule, stages_per_rank, microbatches, measure(schedule, microbatches), theory))
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"\n{'schedule':26} {'v':>2} {'m':>3} {'measured idle':>14} {'theory':>8} {'ratio':>7}")
        for schedule, v, m, measured, theory in rows:
            print(f"{schedule:26} {v:>2} {m:>3} {measured:>14.3f} {theory:>8.3f} {measured / theory:>7.2f}")
        single = [measured / theory for schedule, _, _, measured, theory in rows if schedule in ("gpipe", "1f1b")]
        print(f"gpipe/1f1b measured over theoretical bubble (target within 10%): "
              f"{min(single):.2f}-{max(single):.2f}")


if __name__ == "__main__":
    run_on_ranks(main, PP)
