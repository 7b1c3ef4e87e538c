"""Step time with the diagnostics on vs off, same layout, same model and data, interleaved rounds on 4 CPU processes:
what the monitors cost a healthy run (target <= 1.03), in wall time and in CPU time, with the spread over rounds;
then what each monitor adds alone, per step and per window, in CPU time and in collectives.

    python benchmarks/diagnostics_overhead.py                          # CPU, gloo, 6 rounds
    python benchmarks/diagnostics_overhead.py --rounds 10 --no-breakdown
    python benchmarks/diagnostics_overhead.py --accelerator=cuda       # 4 GPUs, nccl

"on" runs `diagnostics.all_monitors()` as the main job does (examples/train.py, conf ``diagnostics``): the
`RoutingMonitor` (hooks on every router, one reduction and the cards per interval of 10 steps: the MoE layout only,
it does nothing on a dense model), the
`CollectiveMonitor` (point-to-point ledger, store records, topology card, its wait scalars), the `MemoryMonitor`
(scalars every 10 steps), the `BottleneckMonitor` (phase timers every step, a window of 10 steps with one
profiled step, an all-gather and the cards per window), the `LayoutCard` and the `TroubleshootingView`, with a
TensorBoard logger in both columns. The flight recorder's ring is torch's default (2000 entries) in both
columns, so its cost is not in the ratio; setting ``TORCH_FR_BUFFER_SIZE=0`` would remove it from both.

A step's wall time is the time between the starts of consecutive steps, after two warm-up steps; its CPU time is
the process's CPU time over the same span (every thread: the loop, gloo's, the profiler's), which other processes
on a shared host do not inflate the way they inflate wall time. Each round runs off and on once each (the order
alternating); a round's ratio is on/off of the medians (wall: the median over ranks; CPU: the sum over ranks of
each rank's median, the whole job's CPU per step). The table gives the median of the rounds' ratios and their
range: a range straddling 1.0 says the cost is below what this machine can resolve. The median step is an ordinary
one: "mean CPU on/off" is the same ratio of means over every timed step, so each window's work (its profiled step,
its close) is spread over the window's 10 steps; with the library's default window of 50 it is spread five times
thinner.

The breakdown runs each monitor alone once per layout: the CPU time it adds per step (median step, on - off), what
it adds per window of 10 steps (every step's excess over the median, over the windows), and the collectives it issues per
step and per window, counted from the flight recorder's record ids (gloo records every collective, not
point-to-point) with the counting run apart from the timed ones.

Last, the routing monitor alone on the MoE model (every MLP 8 experts, top-2, under dp_shard=4 x ep=2): rounds of
off and on, the `RoutingMonitor` the only callback besides the TensorBoard logger, its CPU on/off ratio.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Bench, StepTimer, build_model, build_moe_model  # noqa: E402
from benchmarks.launch import run_on_ranks  # noqa: E402
from benchmarks.overhead import ACCELERATOR, MICROBATCHES, WARMUP, batches  # noqa: E402

WORLD_SIZE = 4
LAYOUTS = {"dp_shard=4": (1, 4, 1, 1), "dp_shard=2 x tp=2": (1, 2, 2, 1), "pp=2 x dp_shard=2": (2, 2, 1, 1),
           "MoE, dp_shard=4 x ep=2": (1, 4, 1, 2)}
"""(pp, dp_shard, tp, ep); under ep the model's MLPs are experts."""
MOE = "MoE, dp_shard=4 x ep=2"
EVERY = 10
"""Steps per window (BottleneckMonitor) and per memory scalar: the main job's ``*_every_n_steps``."""
STEPS = 2 * EVERY + 1
"""Timed steps: the first window's profiled step and its close fall inside them."""


def monitors(folder: str) -> list:
    from diagnostics import all_monitors

    return all_monitors(log_dir=folder, collectives={"log_every_n_steps": EVERY}, memory={"log_every_n_steps": EVERY},
                        bottleneck={"every_n_steps": EVERY}, routing={"every_n_steps": EVERY})


def routing_alone(folder: str) -> list:
    from diagnostics import RoutingMonitor

    return [RoutingMonitor(log_dir=folder, every_n_steps=EVERY)]


def recorded_collectives() -> int:
    """Collectives this process has issued so far, as the flight recorder numbers them (-1 entries: none)."""
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False, False))
    return max((entry["record_id"] for entry in dump.get("entries", [])), default=-1) + 1


class CollectiveCounter(Callback):
    """The flight recorder's count at the start of every step and at the end: collectives per step."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.counts.append(recorded_collectives())

    def on_train_end(self, trainer, pl_module) -> None:
        self.counts.append(recorded_collectives())

    def per_step(self) -> list[int]:
        return [b - a for a, b in zip(self.counts, self.counts[1:])][WARMUP:]


def run(layout: tuple[int, int, int, int], data, folder: str, extra: list, counter: CollectiveCounter | None = None
        ) -> StepTimer:
    from lightning_nd import NDParallel

    pp, dp_shard, tp, ep = layout
    timer = StepTimer(WARMUP)
    strategy = NDParallel(pp=pp, dp_shard=dp_shard, tp=tp, ep=ep, pp_microbatches=MICROBATCHES if pp > 1 else None)
    logger = TensorBoardLogger(save_dir=folder, name="tb", version=len(os.listdir(folder)))
    trainer = Trainer(strategy=strategy, accelerator=ACCELERATOR, devices=WORLD_SIZE, max_steps=len(data),
                      logger=logger, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[timer, *extra, *([counter] if counter else [])], use_distributed_sampler=False)
    trainer.fit(Bench(build_moe_model if ep > 1 else build_model), train_dataloaders=DataLoader(data, batch_size=None))
    return timer


def _gathered(value: float) -> list[float]:
    import torch.distributed as dist

    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def round_ratios(layout: tuple[int, int, int, int], data, folder: str, round_: int, chosen=monitors
                 ) -> tuple[float, ...]:
    """(wall off, wall on, CPU off, CPU on, mean CPU off, mean CPU on) of one round: seconds per step; the mean
    spreads each window's work (the profiled step, the close) over the window's steps. ``chosen``: the monitors
    "on" runs."""
    timers = {}
    for variant in ("off", "on") if round_ % 2 == 0 else ("on", "off"):  # drift hits both alike
        timers[variant] = run(layout, data, folder, chosen(folder) if variant == "on" else [])
    wall = {v: statistics.median(_gathered(statistics.median(t.step_times))) for v, t in timers.items()}
    cpu = {v: sum(_gathered(statistics.median(t.cpu_step_times))) for v, t in timers.items()}
    mean = {v: sum(_gathered(statistics.mean(t.cpu_step_times))) for v, t in timers.items()}
    return wall["off"], wall["on"], cpu["off"], cpu["on"], mean["off"], mean["on"]


def breakdown(layout: tuple[int, int, int, int], data, folder: str) -> list[tuple[str, float, float, float, float]]:
    """Per monitor alone: (name, CPU ms per step, CPU ms per window, collectives per step, per window) on rank 0.
    Per step: the median step's, less the run without monitors'; per window (every EVERY steps): everything beyond
    the median step (the profiled step, the window's close, the every-EVERY scalars), over the windows."""
    def measured(extra: list) -> tuple[float, float, float, float]:
        timer = run(layout, data, folder, extra, counter := CollectiveCounter())
        cpu, counts = timer.cpu_step_times, counter.per_step()
        windows = sum(1 for i in range(len(cpu)) if (i + WARMUP + 1) % EVERY == 0)
        step_cpu, step_counts = statistics.median(cpu), statistics.median(counts)
        return (step_cpu, (sum(cpu) - len(cpu) * step_cpu) / windows,  # the profiled step, the close, the scalars
                step_counts, (sum(counts) - len(counts) * step_counts) / windows)

    base = measured([])
    rows = []
    for monitor in monitors(folder):
        alone = measured([monitor])
        step_cpu, window_cpu, step_counts, window_counts = (a - b for a, b in zip(alone, base))
        rows.append((type(monitor).__name__, step_cpu * 1e3, window_cpu * 1e3, step_counts, window_counts))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--accelerator")  # read by benchmarks.overhead
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    rows, parts = [], {}
    with tempfile.TemporaryDirectory() as folder:
        for name, layout in LAYOUTS.items():
            data = batches((rank // layout[2]) % layout[1], STEPS + WARMUP)
            rounds = [round_ratios(layout, data, folder, r) for r in range(args.rounds)]
            rows.append((name, rounds))
            if not args.no_breakdown:
                parts[name] = breakdown(layout, data, folder)
        moe = LAYOUTS[MOE]
        data = batches((rank // moe[2]) % moe[1], STEPS + WARMUP)
        routing = [round_ratios(moe, data, folder, r, routing_alone) for r in range(args.rounds)]
    if rank != 0:
        return
    print(f"\n{'layout':24} {'wall off':>9} {'wall on':>9} {'wall on/off [range]':>22} {'CPU off':>9} {'CPU on':>9}"
          f" {'CPU on/off [range]':>22} {'mean CPU on/off':>16}")
    worst = 0.0
    for name, rounds in rows:
        wall = sorted(r[1] / r[0] for r in rounds)
        cpu = sorted(r[3] / r[2] for r in rounds)
        mean = sorted(r[5] / r[4] for r in rounds)
        worst = max(worst, statistics.median(cpu))
        print(f"{name:24} {statistics.median(r[0] for r in rounds) * 1e3:>7.1f}ms"
              f" {statistics.median(r[1] for r in rounds) * 1e3:>7.1f}ms"
              f" {statistics.median(wall):>8.3f} [{wall[0]:.3f}-{wall[-1]:.3f}]"
              f" {statistics.median(r[2] for r in rounds) * 1e3:>7.1f}ms {statistics.median(r[3] for r in rounds) * 1e3:>7.1f}ms"
              f" {statistics.median(cpu):>8.3f} [{cpu[0]:.3f}-{cpu[-1]:.3f}]"
              f" {statistics.median(mean):>7.3f} [{mean[0]:.3f}-{mean[-1]:.3f}]")
    print(f"{len(rows[0][1])} rounds; CPU: the 4 ranks' CPU seconds per step. Max median CPU on/off (target <= 1.03):"
          f" {worst:.3f}. mean CPU: every step's, a window's work ({EVERY} steps) included")
    for name, monitors_alone in parts.items():
        print(f"\n{name}, each monitor alone (rank 0; CPU ms and collectives, per step and at a window's close)")
        print(f"{'monitor':22} {'CPU/step':>9} {'CPU/window':>11} {'coll/step':>10} {'coll/window':>12}")
        for monitor, step_cpu, window_cpu, step_counts, window_counts in monitors_alone:
            print(f"{monitor:22} {step_cpu:>7.2f}ms {window_cpu:>9.1f}ms {step_counts:>10.1f} {window_counts:>12.1f}")
    cpu, mean = sorted(r[3] / r[2] for r in routing), sorted(r[5] / r[4] for r in routing)
    print(f"\nRoutingMonitor alone, {MOE}: CPU per step off {statistics.median(r[2] for r in routing) * 1e3:.1f}ms,"
          f" on {statistics.median(r[3] for r in routing) * 1e3:.1f}ms; CPU on/off {statistics.median(cpu):.3f}"
          f" [{cpu[0]:.3f}-{cpu[-1]:.3f}], mean CPU on/off (its interval's close included)"
          f" {statistics.median(mean):.3f} [{mean[0]:.3f}-{mean[-1]:.3f}], {len(routing)} rounds")


if __name__ == "__main__":
    run_on_ranks(main, WORLD_SIZE)
