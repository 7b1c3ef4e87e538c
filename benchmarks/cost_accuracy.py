"""Does the calibrated cost model predict this host? Predicted and measured step time and tensor memory of the
example models over the planner's layouts on 4 CPU processes, after one calibration.

    python benchmarks/cost_accuracy.py [--models llama,gpt,moe,llama_wide] [--layouts 10] [--rounds 3] [--steps 8]
                                       [--per-launch 1] [--profile host|PATH] [--refresh-profile]

This process calibrates the host once (``host_profile``: the cached profile, measured on first use), lists each
model's layouts as the planner ranks them with that profile (`lightning_nd.planner.shortlist`, one global batch per
model: the example's ``data.batch_size`` x 4; one layout per set of dim sizes first, then other knobs), and starts 4
fresh ranks (torchrun) per layout and round. The ranks train each layout as the example does (`examples.lit.CausalLM`,
its data, `NDParallel`), in ``--rounds`` interleaved rounds (every layout of every model once per round, the order
rotated, the models' order reversed every other round) so the host's drift falls on all alike; a layout's step is the median over rounds of the slowest rank's median step
after 2 warm-up steps, from a batch's start to its end (forward, backward, collectives, optimizer: what the cost
model prices; the data loader's time between steps is the user's pipeline, not the layout's, and is printed apart). Then one untimed run per layout measures the highest rank's tensor memory with torch's
`MemTracker` (`benchmarks.common.PeakMemory`). ``llama_wide`` (twice the width, half the depth) is the model the step
model was not written against.

Printed per model: each layout's predicted and measured step and memory with their ratios, then the median and
worst |predicted / measured - 1| of both, Spearman(predicted, measured step), Spearman between rounds (the noise
ceiling: how well one round ranks the layouts like another), the between-rounds spread of the best layout, and
whether the predicted first pick is the measured best (or within max(5%, that spread) of it). Nothing in the step
model is fitted to these numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning.pytorch import Callback

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.layout_search import spearman  # noqa: E402

DEVICES = 4
WARMUP = 2
MODELS = {"llama": ["model=llama"], "gpt": ["model=gpt"], "moe": ["model=moe"],
          "llama_wide": ["model=llama", "model.hidden_size=128", "model.intermediate_size=256",
                         "model.num_hidden_layers=2"]}
"""name: the example's Hydra overrides (``llama_wide``: the example Llama at twice the width and half the depth)."""


def plan(models: list[str], count: int, profile_path: Path) -> list[dict]:
    """Each model's first ``count`` layouts as the profile ranks them, as the ranks need them."""
    from examples.schema import compose
    from examples.search import meta_model
    from examples.train import model_factory
    from lightning_nd.cost.op_count import count_model_ops
    from lightning_nd.cost.profile import HostProfile
    from lightning_nd.planner.search import describe_sizes
    from lightning_nd.planner.shortlist import per_rank_batch, shortlist

    profile = HostProfile.load(profile_path)
    rows = []
    for name in models:
        cfg = compose([*MODELS[name], f"trainer.devices={DEVICES}"])
        module = meta_model(model_factory(cfg.model))
        global_batch = cfg.data.batch_size * DEVICES
        found = shortlist(module, DEVICES, DEVICES, 6 * 10**9, cfg.data.seq_len, global_batch, profile=profile,
                          ops=count_model_ops(module))
        for rank, candidate in enumerate(found.ordered[:count]):
            time = candidate.cost.time
            assert time is not None
            rows.append({"model": name, "overrides": MODELS[name], "rank": rank + 1,
                         "layout": describe_sizes(candidate.sizes), "sizes": candidate.sizes,
                         "options": candidate.options, "batch": per_rank_batch(candidate),
                         "predicted_s": time.total_s, "predicted_bytes": candidate.cost.peak.peak_bytes})
    return rows


def train(row: dict, steps: int, callbacks: list) -> None:
    """One layout of one model, trained as the example trains it (no logger, checkpoint or validation)."""
    from lightning.pytorch import Trainer, seed_everything
    from omegaconf import OmegaConf

    from examples.data import TokenDataModule
    from examples.lit import CausalLM
    from examples.schema import compose
    from examples.train import model_factory
    from lightning_nd import NDParallel

    cfg = compose([*row["overrides"], f"trainer.devices={DEVICES}"])
    seed_everything(0, verbose=False)
    data = {**OmegaConf.to_container(cfg.data, resolve=True), "batch_size": row["batch"]}
    data["num_samples"] = row["batch"] * DEVICES * (steps + 1)
    trainer = Trainer(strategy=NDParallel(**row["sizes"], **row["options"]), accelerator="cpu", devices=DEVICES,
                      max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, callbacks=callbacks)
    trainer.fit(CausalLM(model_factory=model_factory(cfg.model), lr=cfg.lr), datamodule=TokenDataModule(**data))


class InStep(Callback):
    """Each step's time from its batch's start to its end, and the time between steps, after the warm-up."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def on_train_batch_start(self, *_: object) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, *_: object) -> None:
        self.ends.append(time.perf_counter())

    def medians(self) -> tuple[float, float]:
        steps = [end - start for start, end in zip(self.starts, self.ends)][WARMUP:]
        between = [start - end for end, start in zip(self.ends, self.starts[1:])][WARMUP:]
        return statistics.median(steps), statistics.median(between)


def slowest(value: float) -> float:
    import torch
    import torch.distributed as dist

    everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, torch.tensor([value], dtype=torch.float64))
    return max(float(t) for t in everyone)


def ranks_main(job_file: Path, out_file: Path, steps: int) -> None:
    """On each of the 4 ranks: one model's layouts timed once each in the job's order (``round`` >= 0), or each
    one's memory measured in a run that is not timed (``round`` < 0)."""
    import warnings

    from benchmarks.common import PeakMemory

    warnings.filterwarnings("ignore")
    job = json.loads(job_file.read_text())
    rows, round_ = job["rows"], job["round"]
    results: dict[int, dict[str, float]] = {}
    for index in job["order"]:
        if round_ < 0:
            probe = PeakMemory(step=1)
            train(rows[index], 2, [probe])
            results[index] = {"measured_bytes": slowest(float(probe.peak_bytes))}
            continue
        timer = InStep()
        train(rows[index], steps, [timer])
        step, between = (slowest(value) for value in timer.medians())
        results[index] = {"step_s": step, "between_s": between}
        if int(os.environ["RANK"]) == 0:
            print(f"round {round_ + 1} {rows[index]['model']} {rows[index]['layout']}: {step * 1e3:.0f} ms", flush=True)
    if int(os.environ["RANK"]) == 0:
        out_file.write_text(json.dumps(results))


def report(rows: list[dict]) -> None:
    for name in dict.fromkeys(row["model"] for row in rows):
        mine = [row for row in rows if row["model"] == name]
        for row in mine:
            row["measured_s"] = statistics.median(row["steps_s"])
        print(f"\n## {name}: {len(mine)} layouts\n\n| planner rank | layout | knobs | predicted step | measured step |"
              " predicted / measured | measured rank | between steps | predicted memory | measured memory |"
              " predicted / measured |\n|---|---|---|---|---|---|---|---|---|---|---|")
        by_measured = sorted(mine, key=lambda r: r["measured_s"])
        for row in mine:
            print(f"| {row['rank']} | `{row['layout']}` | {row['options']} | {row['predicted_s'] * 1e3:.1f} ms |"
                  f" {row['measured_s'] * 1e3:.1f} ms | {row['predicted_s'] / row['measured_s']:.2f} |"
                  f" {by_measured.index(row) + 1} | {statistics.median(row['between_s']) * 1e3:.1f} ms |"
                  f" {row['predicted_bytes'] / 2**20:.2f} MiB |"
                  f" {row['measured_bytes'] / 2**20:.2f} MiB | {row['predicted_bytes'] / row['measured_bytes']:.2f} |")
        step_errors = [abs(r["predicted_s"] / r["measured_s"] - 1) for r in mine]
        memory_errors = [abs(r["predicted_bytes"] / r["measured_bytes"] - 1) for r in mine]
        rho = spearman([r["predicted_s"] for r in mine], [r["measured_s"] for r in mine])
        rounds = len(mine[0]["steps_s"])
        between = [spearman([r["steps_s"][a] for r in mine], [r["steps_s"][b] for r in mine])
                   for a in range(rounds) for b in range(a + 1, rounds)]
        best, pick = by_measured[0], min(mine, key=lambda r: r["predicted_s"])
        spread = (max(best["steps_s"]) - min(best["steps_s"])) / best["measured_s"]
        slower = pick["measured_s"] / best["measured_s"] - 1
        print(f"\nstep |predicted / measured - 1|: median {statistics.median(step_errors):.2f}, worst"
              f" {max(step_errors):.2f} (targets 0.25, 0.6); memory: median {statistics.median(memory_errors):.2f},"
              f" worst {max(memory_errors):.2f} (target 0.15)\nSpearman(predicted, measured step) {rho:.2f};"
              f" between rounds {min(between, default=float('nan')):.2f} to {max(between, default=float('nan')):.2f}"
              f" (target: at least min(0.9, between rounds))\nfirst pick `{pick['layout']}` is"
              f" {'the measured best' if pick is best else f'{slower:.1%} slower than the measured best'}"
              f" `{best['layout']}` (best's spread between rounds {spread:.1%}; target within max(5%, spread))")


def launch(rows: list[dict], order: list[int], round_: int, steps: int) -> dict[str, dict[str, float]]:
    """One job on 4 fresh ranks (torchrun): a process that trained several layouts grows slower (each layout's
    process groups and caches stay: the Llama's first layout of a start of ten took 59 ms a step, and 81 ms when it
    came last), so each layout is timed in ranks of its own by default (``--per-launch``), as each run of a search
    is; memory, which this does not change, is measured for one model's layouts per start."""
    with tempfile.TemporaryDirectory() as scratch:
        job_file, out_file = Path(scratch) / "job.json", Path(scratch) / "out.json"
        job_file.write_text(json.dumps({"rows": rows, "order": order, "round": round_}))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={DEVICES}",
                   __file__, "--steps", str(steps), "--ranks", str(job_file), str(out_file)]
        done = subprocess.run(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print("".join(line for line in done.stdout.splitlines(keepends=True) if line.startswith("round ")), end="",
              flush=True)
        if done.returncode:
            raise RuntimeError(f"The ranks failed (exit status {done.returncode}):\n{done.stdout[-3000:]}")
        return json.loads(out_file.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layouts", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile", default="host", help="`host` (this host's cached profile) or a profile file")
    parser.add_argument("--refresh-profile", action="store_true")
    parser.add_argument("--per-launch", type=int, default=1, help="layouts timed by one start of the 4 ranks")
    parser.add_argument("--ranks", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ranks:
        import torch.distributed as dist

        ranks_main(Path(args.ranks[0]), Path(args.ranks[1]), args.steps)
        dist.barrier()  # rank 0 has written the results
        sys.stdout.flush()
        # The interpreter's teardown is skipped: one start in about 45 aborted there after its results were written
        # ("terminate called without an active exception"), which failed the whole benchmark.
        os._exit(0)
    from lightning_nd.cost.calibrate import host_profile

    started = time.perf_counter()
    profile_path = (host_profile(refresh=args.refresh_profile, processes=DEVICES)[1] if args.profile == "host"
                    else Path(args.profile))
    rows = plan(args.models.split(","), args.layouts, profile_path)
    print(f"priced by {profile_path}; {len(rows)} layouts, {args.rounds} rounds of {args.steps} steps", flush=True)
    models = list(dict.fromkeys(row["model"] for row in rows))
    for round_ in [*range(args.rounds), -1]:  # -1: the memory runs, after the timed rounds
        for name in models if round_ % 2 == 0 else models[::-1]:
            mine = [row for row in rows if row["model"] == name]
            order = list(range(len(mine)))
            order = order[max(round_, 0) % len(order):] + order[:max(round_, 0) % len(order)]
            size = len(order) if round_ < 0 else args.per_launch
            for first in range(0, len(order), size):
                for index, result in launch(mine, order[first:first + size], round_, args.steps).items():
                    for key, value in result.items():
                        mine[int(index)].setdefault(key, []).append(value)
    for row in rows:
        row["steps_s"], row["measured_bytes"] = row.pop("step_s"), row["measured_bytes"][0]
    report(rows)
    print(f"\nran in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
