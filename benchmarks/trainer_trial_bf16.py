"""How far bf16-mixed runs drift from one process in bf16-mixed: plain Lightning DDP beside `NDParallel`'s layouts.

    python benchmarks/trainer_trial_bf16.py

The run is the Trainer trial's ``bf16`` run (`tests/distributed/trainer_trial_ranks.py`: an MLP classifier, SGD with
momentum, 3 epochs of 4 steps, clipping by value, a validation): one process in bf16-mixed is the reference, then DDP
and `NDParallel` on 2 and on 4 CPU processes, each with the same global batch. Each column is the largest relative
difference from the reference: per-step training loss, each validation loss, and each parameter tensor after
training (the norm of the difference over the tensor's norm). The trial's test allows 2e-2 for every layout; this
table says what plain Lightning's own data parallelism shows on the same run, the spread that tolerance stands for.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.distributed.trainer_trial_ranks import ordered
from tests.launcher import launch

LAYOUTS = {2: {"ddp": None, "dp_shard=2": {"dp_shard": 2}},
           4: {"ddp": None, "dp_shard=2,tp=2": {"dp_shard": 2, "tp": 2},
               "dp_replicate=2,dp_shard=2": {"dp_replicate": 2, "dp_shard": 2}, "pp=2,dp_shard=2": {"pp": 2, "dp_shard": 2}}}


def ranks(root: str, layouts: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """Every layout on these ranks, in bf16-mixed (``None``: Lightning's own DDP)."""
    import os

    from lightning_nd import NDParallel

    world = int(os.environ["WORLD_SIZE"])
    return {name: ordered(NDParallel(**layout) if layout is not None else "ddp", world, Path(root) / name,
                          precision="bf16-mixed") for name, layout in layouts.items()}


def spread(got: list[dict[str, Any]], expected: dict[str, Any]) -> tuple[float, float, float]:
    """Largest relative differences from ``expected``: step losses, validation losses, parameters (merged over ranks)."""
    record, wanted = got[0]["record"], expected["record"]
    loss = max(abs(b["loss"] - w["loss"]) / abs(w["loss"]) for b, w in zip(record["batches"], wanted["batches"]))
    val = max((abs(v[key] - w[key]) / abs(w[key]) for v, w in zip(record["validations"], wanted["validations"])
               for key in w if key.startswith("val_loss")), default=0.0)
    end = {name: value for rank in got for name, value in rank["end"].items()}
    params = max(float((end[name] - value).norm() / value.norm()) for name, value in expected["end"].items())
    return loss, val, params


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        expected = ordered("auto", 1, root / "one", precision="bf16-mixed")
        rows = []
        for world, layouts in LAYOUTS.items():
            results = launch("benchmarks.trainer_trial_bf16:ranks", world, root / f"out{world}", timeout=900,
                             root=str(root / f"ranks{world}"), layouts=layouts)
            for name in layouts:
                rows.append((world, name, *spread([rank[name] for rank in results], expected)))
    print("| processes | run | step loss | validation loss | parameters (norm) |")
    print("|---|---|---|---|---|")
    for world, name, loss, val, params in rows:
        print(f"| {world} | {'Lightning DDP' if name == 'ddp' else f'NDParallel({name})'} | {loss:.1e} | {val:.1e} |"
              f" {params:.1e} |")


if __name__ == "__main__":
    main()
