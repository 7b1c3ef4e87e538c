"""The layout search against the exhaustive grid: does measuring the planner's first few layouts find the best?

    python benchmarks/layout_search.py [--devices 4] [--budget 4] [--rounds 2] [--steps 8]

The grid is every set of dim sizes the planner finds valid for the example model on ``--devices`` ranks (at most 12,
each with the knobs the planner picks for it: `lightning_nd.planner.shortlist`), run as ``examples/train.py`` does
(Lightning starts the ranks), at one global batch. Rounds are interleaved (every layout once per round, the order
rotated) so the machine's drift falls on all alike; a layout's throughput is its median over rounds. The search's
answer is the best measured among the planner's first ``--budget``, taken from the same runs, so the two answers
differ only by which layouts they looked at. Printed side by side: each layout's measured and predicted step,
their ratio, the planner's rank and the measured rank; then the search's best over the grid's best (target: at
least 0.9 with ``--budget 4``) and the rank correlation (Spearman) between predicted and measured step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from examples.schema import compose  # noqa: E402
from examples.search import layout_overrides, meta_model  # noqa: E402
from examples.train import model_factory  # noqa: E402
from lightning_nd.cost.hardware import parse_hardware  # noqa: E402
from lightning_nd.planner.search import describe_sizes  # noqa: E402
from lightning_nd.planner.shortlist import shortlist  # noqa: E402

GRID_MAX = 12


def measure(overrides: list[str], devices: int, steps: int, folder: Path) -> dict:
    command = [sys.executable, str(REPO / "examples" / "train.py"), *overrides, f"trainer.devices={devices}",
               f"trainer.max_steps={steps}", "trainer.limit_val_batches=0", "diagnostics=off",
               "checkpoint.save_top_k=0", "checkpoint.save_last=false", f"hydra.run.dir={folder}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    record = folder / "tensorboard" / "diagnostics" / "run.json"
    if done.returncode != 0 or not record.is_file():
        return {"status": "failed", "tail": (done.stdout + done.stderr)[-800:]}
    return json.loads(record.read_text())


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, index in enumerate(order):
            out[index] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1)) if n > 1 else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--budget", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    cfg = compose(["parallel=search", f"trainer.devices={args.devices}"])
    global_batch = cfg.data.batch_size * args.devices
    found = shortlist(meta_model(model_factory(cfg.model)), args.devices, args.devices, 6 * 10**9, cfg.data.seq_len, global_batch,
                      hardware=parse_hardware("cpu"))
    grid = list(found.firsts[:GRID_MAX])
    print(f"{len(grid)} layouts (the planner's order), {args.rounds} interleaved rounds of {args.steps} steps,"
          f" global batch {global_batch}, {args.devices} ranks", flush=True)
    speeds: dict[int, list[float]] = {i: [] for i in range(len(grid))}
    steps: dict[int, list[float]] = {i: [] for i in range(len(grid))}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            order = list(range(len(grid)))
            order = order[round_ % len(order):] + order[:round_ % len(order)]
            for index in order:
                record = measure(layout_overrides(grid[index]), args.devices, args.steps,
                                 Path(scratch) / f"{round_}-{index}")
                if record.get("status") == "ok" and record.get("tokens_per_s"):
                    speeds[index].append(record["tokens_per_s"])
                    steps[index].append(record["step_s"])
                else:
                    print(f"  {describe_sizes(grid[index].sizes)} failed: {record.get('tail', record)}", flush=True)
                print(f"  round {round_ + 1}: {describe_sizes(grid[index].sizes)} done", flush=True)
    measured = {i: statistics.median(v) for i, v in speeds.items() if v}
    by_speed = sorted(measured, key=measured.get, reverse=True)
    print("\n| planner rank | layout | knobs | predicted step | measured step | predicted / measured | tokens/s |"
          " measured rank |\n|---|---|---|---|---|---|---|---|")
    for index, candidate in enumerate(grid):
        predicted = candidate.cost.time.total_s
        step = statistics.median(steps[index]) if steps[index] else None
        cells = (f"{step * 1e3:.0f} ms", f"{predicted / step:.3f}", f"{measured[index]:,.0f}",
                 str(by_speed.index(index) + 1)) if step else ("-", "-", "failed", "-")
        print(f"| {index + 1} | `{describe_sizes(candidate.sizes)}` | {candidate.options} | {predicted * 1e3:.2f} ms | "
              + " | ".join(cells) + " |")
    searched = [i for i in range(min(args.budget, len(grid))) if i in measured]
    best_grid, best_search = by_speed[0], max(searched, key=measured.get)
    ratio = measured[best_search] / measured[best_grid]
    common = sorted(measured)
    rho = spearman([grid[i].cost.time.total_s for i in common], [statistics.median(steps[i]) for i in common])
    print(f"\nsearch (first {args.budget} of the planner) best: `{describe_sizes(grid[best_search].sizes)}`"
          f" {measured[best_search]:,.0f} tokens/s; grid ({len(grid)} runs) best: "
          f"`{describe_sizes(grid[best_grid].sizes)}` {measured[best_grid]:,.0f} tokens/s; ratio {ratio:.3f}"
          f" (target >= 0.9); Spearman(predicted, measured step) = {rho:.2f}")


if __name__ == "__main__":
    main()
