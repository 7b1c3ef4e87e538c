"""A synchronous vs an asynchronous checkpoint save under `Trainer(strategy=NDParallel(dp_shard=2))`, on 2 CPU
processes (gloo): a 100.7M-parameter model (24 blocks of Linear(2048, 2048) + GELU) trained with AdamW, so a
checkpoint holds 1.2 GB (parameters and both moments), 0.6 GB per rank.

    python benchmarks/async_save.py

One fit per variant and host kind, the same model and data: a `trainer.save_checkpoint` after each step of
``SAVES_AT`` (far enough apart for each write to commit before the next save), ``STEPS`` steps in all. Per variant,
the worst rank's median over its saves: the time the loop was blocked in the save call; the time from the call until
the checkpoint was whole (the `CheckpointCommitted` event; the blocked time for a synchronous save); and the time
added to the run: what the saving step and the steps the write overlapped took beyond the median of the other steps
(a write competing with training for the cores slows the steps it overlaps, which this counts), plus any wait for
the commit at the end of fit.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.launch import run_on_ranks

WORLD_SIZE = 2
WIDTH, BLOCKS, BATCH = 2048, 24, 8
WARMUP, SAVES_AT, STEPS = 1, (3, 7, 11), 14
HOSTS = {"CPU-bound steps (every core trains)": 0.0, "steps that leave the host idle 1.5 s (as a GPU's)": 1.5}
"""How long each training step sleeps before its compute: with 2 ranks on a 2-core host, 0 leaves the write no free
core; a sleeping step leaves the cores free for that long, as a GPU run's host waits for its kernels."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.linear(x))


class Regression(LightningModule):
    def __init__(self, idle_s: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.idle_s = idle_s
        self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS)])

    def training_step(self, batch, batch_idx):
        time.sleep(self.idle_s)
        inputs, targets = batch
        return F.mse_loss(self.blocks(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Saves(Callback):
    """Step starts; a `save_checkpoint` after each step of ``SAVES_AT`` (its call time and blocked time); each
    commit's time since its call (`CheckpointCommitted`)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.starts, self.called, self.blocked, self.committed = folder, [], [], [], []
        self.ended = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in SAVES_AT:
            self.called.append(time.perf_counter())
            trainer.save_checkpoint(self.folder / f"step={trainer.global_step}.ckpt")
            self.blocked.append(time.perf_counter() - self.called[-1])

    def on_train_end(self, trainer, pl_module) -> None:
        self.ended = time.perf_counter()

    def on_nd_checkpoint_committed(self, strategy, event) -> None:
        self.committed.append(event.seconds)


def measure(async_save: bool, idle_s: float, folder: Path) -> dict[str, float]:
    """One fit; medians over its saves (the time added to the run: per save)."""
    from lightning_nd import NDParallel

    data = TensorDataset(torch.randn(BATCH * STEPS, WIDTH, generator=torch.Generator().manual_seed(1)),
                         torch.randn(BATCH * STEPS, WIDTH, generator=torch.Generator().manual_seed(2)))
    probe = Saves(folder / ("async" if async_save else "sync"))
    trainer = Trainer(strategy=NDParallel(dp_shard=WORLD_SIZE, block_classes=[Block], async_save=async_save),
                      accelerator="cpu", devices=WORLD_SIZE, max_steps=STEPS, callbacks=[probe], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(idle_s), DataLoader(data, batch_size=BATCH // WORLD_SIZE))
    committed = probe.committed if async_save else probe.blocked
    assert len(committed) == len(SAVES_AT), "the end of fit waits for the last commit and delivers its event"
    steps = [b - a for a, b in zip(probe.starts, [*probe.starts[1:], probe.ended])]
    landed = [called + seconds for called, seconds in zip(probe.called, committed)]
    overlapping = [[i for i in range(step - 1, STEPS) if i == step - 1 or probe.starts[i] < end]  # step - 1: saving
                   for step, end in zip(SAVES_AT, landed)]
    typical = statistics.median(d for i, d in enumerate(steps) if i >= WARMUP and all(i not in o for o in overlapping))
    added = [sum(steps[i] - typical for i in o) + max(0.0, end - probe.ended) for o, end in zip(overlapping, landed)]
    return {"blocked_s": statistics.median(probe.blocked), "committed_s": statistics.median(committed),
            "added_s": statistics.median(added), "step_s": typical,
            "overlapped_steps": statistics.median(len(o) - 1 for o in overlapping)}


def main() -> None:
    folder = Path(tempfile.gettempdir()) / f"lightning-nd-async-save-{os.environ['MASTER_PORT']}"
    load = os.getloadavg()
    started = time.perf_counter()
    results = {host: (measure(False, idle_s, folder), measure(True, idle_s, folder)) for host, idle_s in HOSTS.items()}
    everyone = [None] * WORLD_SIZE
    dist.all_gather_object(everyone, results)
    if dist.get_rank() != 0:
        return
    size = sum(p.stat().st_size for p in (folder / "sync" / "step=3.ckpt").iterdir()) / 1e9
    params = sum(p.numel() for p in Regression().parameters()) / 1e6
    print(f"\nmodel {params:.1f}M parameters, AdamW; checkpoint {size:.2f} GB; {WORLD_SIZE} ranks, dp_shard=2, gloo")
    print(f"host: {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), load average before"
          f" {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}, after {os.getloadavg()[0]:.2f}")
    for host in HOSTS:
        sync, later = ({key: max(rank[host][i][key] for rank in everyone) for key in results[host][i]} for i in (0, 1))
        print(f"\n{host + ', worst rank, s':<52}{'synchronous':>12}{'asynchronous':>14}{'async/sync':>12}")
        for key, label in (("blocked_s", "loop blocked in save_checkpoint"),
                           ("committed_s", "from the call until the checkpoint is whole"),
                           ("added_s", "added to the run"), ("step_s", "a training step (median, away from the save)")):
            print(f"{label:<52}{sync[key]:>12.2f}{later[key]:>14.2f}{later[key] / sync[key]:>12.2f}")
        print(f"the asynchronous write committed {later['committed_s'] - later['blocked_s']:.2f} s after the call"
              f" returned, {later['overlapped_steps']:.0f} training step(s) overlapping it (medians of {len(SAVES_AT)}"
              " saves)")
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f} s")
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    run_on_ranks(main, world_size=WORLD_SIZE)
