"""Step time with the diagnostics on vs off, same layout, same model and data, interleaved rounds on 4 CPU processes:
the ratio of medians is what the monitors cost a healthy run (target <= 1.03).

    python benchmarks/diagnostics_overhead.py                      # CPU, gloo
    python benchmarks/diagnostics_overhead.py --accelerator=cuda   # 4 GPUs, nccl

"on" runs `diagnostics.all_monitors()` as the main job does (examples/train.py, conf ``diagnostics``): the
`CollectiveMonitor` (point-to-point ledger, store records, topology card, its wait scalars), the `MemoryMonitor`
(scalars every 10 steps), the `BottleneckMonitor` (phase timers every step, a window of 10 steps with one
profiled step, an all-gather and the cards per window), the `LayoutCard` and the `TroubleshootingView`, with a
TensorBoard logger in both columns. The flight recorder's ring is torch's default (2000 entries) in both
columns, so its cost is not in the ratio; setting ``TORCH_FR_BUFFER_SIZE=0`` would remove it from both. A step's
time is the wall time between the starts of consecutive steps, after two warm-up steps; medians over all rounds
(the profiled steps are in them: the ratio includes what the sampling costs).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Bench, StepTimer, build_model  # noqa: E402
from benchmarks.launch import run_on_ranks  # noqa: E402
from benchmarks.overhead import ACCELERATOR, MICROBATCHES, WARMUP, batches  # noqa: E402

WORLD_SIZE = 4
ROUNDS = 4
LAYOUTS = {"dp_shard=4": (1, 4, 1), "dp_shard=2 x tp=2": (1, 2, 2), "pp=2 x dp_shard=2": (2, 2, 1)}


EVERY = 10
"""Steps per window (BottleneckMonitor) and per memory scalar: the main job's ``*_every_n_steps``."""
STEPS = 2 * EVERY + 1
"""Timed steps: the first window's profiled step and its close fall inside them."""


def monitors(folder: str) -> list:
    from diagnostics import all_monitors

    return all_monitors(log_dir=folder, collectives={"log_every_n_steps": EVERY},
                        memory={"log_every_n_steps": EVERY}, bottleneck={"every_n_steps": EVERY})


def run(pp: int, dp_shard: int, tp: int, data, folder: str, on: bool) -> list[float]:
    from lightning_nd import NDParallel

    timer = StepTimer(WARMUP)
    strategy = NDParallel(pp=pp, dp_shard=dp_shard, tp=tp, pp_microbatches=MICROBATCHES if pp > 1 else None)
    logger = TensorBoardLogger(save_dir=folder, name="tb", version=len(os.listdir(folder)))
    trainer = Trainer(strategy=strategy, accelerator=ACCELERATOR, devices=WORLD_SIZE, max_steps=len(data),
                      logger=logger, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[timer, *(monitors(folder) if on else [])], use_distributed_sampler=False)
    trainer.fit(Bench(build_model), train_dataloaders=DataLoader(data, batch_size=None))
    return timer.step_times


def main() -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, (pp, dp_shard, tp) in LAYOUTS.items():
            data = batches((rank // tp) % dp_shard, STEPS + WARMUP)
            times: dict[str, list[float]] = {"off": [], "on": []}
            for round_ in range(ROUNDS):  # alternate which goes first: drift hits both alike
                order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
                for variant in order:
                    times[variant] += run(pp, dp_shard, tp, data, folder, variant == "on")
            rows.append((name, statistics.median(times["off"]), statistics.median(times["on"])))
            dist.barrier()
    if rank == 0:
        print(f"\n{'layout':20} {'off':>10} {'on':>10} {'on/off':>8}")
        for name, off, on in rows:
            print(f"{name:20} {off * 1e3:>8.1f}ms {on * 1e3:>8.1f}ms {on / off:>8.3f}")
        print(f"max on/off (target <= 1.03): {max(on / off for _, off, on in rows):.3f}")


if __name__ == "__main__":
    run_on_ranks(main, WORLD_SIZE)
