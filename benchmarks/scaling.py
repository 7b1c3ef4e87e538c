"""Tokens per second and model-state memory per rank for 1, 2, 4 and 8 ranks at a fixed global batch
(FSDP over every rank, `NDParallel(dp_shard=-1)`), one torchrun launch per world size.

    python benchmarks/scaling.py

On this 2-core machine more than 2 ranks share cores, so tokens/s shows the cost of oversubscription
more than scaling; the memory column shows the 1/n share FSDP promises. On a GPU node pass
`--accelerator cuda` (see gpu_check.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import MODEL_CONFIG, Bench, StepTimer, build_model, state_bytes  # noqa: E402

WORLD_SIZES = (1, 2, 4, 8)
GLOBAL_BATCH, SEQ, STEPS, WARMUP = 16, 128, 8, 2
RESULT = "SCALING_RESULT "


def worker(accelerator: str) -> None:
    from lightning_nd import NDParallel

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    per_rank = GLOBAL_BATCH // world
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(MODEL_CONFIG["vocab_size"], (STEPS + WARMUP, per_rank, SEQ + 1), generator=generator)
    data = DataLoader([(t[:, :-1], t[:, 1:]) for t in tokens], batch_size=None)
    timer, module = StepTimer(WARMUP), Bench(build_model)
    trainer = Trainer(strategy=NDParallel(dp_shard=-1), accelerator=accelerator, devices=world,
                      max_steps=STEPS + WARMUP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[timer], use_distributed_sampler=False)
    trainer.fit(module, train_dataloaders=data)
    step_times = timer.step_times
    if rank == 0:
        median = sorted(step_times)[len(step_times) // 2]
        print(RESULT + json.dumps({"world": world, "tokens_per_s": GLOBAL_BATCH * SEQ / median,
                                   "state_bytes": state_bytes(list(module.parameters()), trainer.optimizers[0])}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--max-ranks", type=int, default=max(WORLD_SIZES), help="largest world size to run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.accelerator)
        return
    rows = []
    for world in [w for w in WORLD_SIZES if w <= args.max_ranks]:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   __file__, "--worker", f"--accelerator={args.accelerator}"]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
        done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
        if done.returncode or not lines:
            sys.exit(f"world size {world} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        rows.append(json.loads(lines[0][len(RESULT):]))
    base = rows[0]
    print(f"\n{'ranks':>5} {'tokens/s':>10} {'speed-up':>9} {'state bytes/rank':>17} {'x of 1 rank':>12}")
    for row in rows:
        print(f"{row['world']:>5} {row['tokens_per_s']:>10.0f} {row['tokens_per_s'] / base['tokens_per_s']:>9.2f}"
              f" {row['state_bytes']:>17,} {row['state_bytes'] / base['state_bytes']:>12.3f}")
    last = rows[-1]
    print(f"{last['world']} ranks: state per rank {last['state_bytes'] / base['state_bytes']:.3f}x of one rank"
          f" (ideal {1 / last['world']:.3f}), throughput {last['tokens_per_s'] / base['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
