"""The check's result as markdown: one row per checked rank, then the first failure (or what was not checked)."""

from __future__ import annotations

from lightning_nd.check.run import CheckResult, RankOutcome
from lightning_nd.mesh.dims import MESH_DIMS

VERDICTS = {
    "ok": "set up, one step (forward, backward, optimizer)",
    "failed": "failed",
    "hang": "hung",
    "waited": "stopped: the rank it waits for failed",
    "unchecked": "not checked past a value computed from the weights",
    "nostep": "set up, but no optimizer step ran",
}


def check_markdown(result: CheckResult) -> str:
    varied = [name for name in MESH_DIMS if result.dims.get(name, 1) > 1]
    lines = [f"# Check: {len(result.outcomes)} of {result.world_size} ranks, one training step each on fake tensors"
             f" ({result.seconds:.1f} s)", "",
             "| rank | " + " | ".join(varied) + " | outcome | s |", "|---" * (len(varied) + 3) + "|"]
    for o in sorted(result.outcomes, key=lambda o: o.rank):
        lines.append(f"| {o.rank} | " + " | ".join(str(o.coordinates[name]) for name in varied)
                     + f" | {VERDICTS[o.status]} | {o.seconds:.1f} |")
    failure = result.first_failure
    if failure is not None:
        where = f" in `{failure.module}`" if failure.module else ""
        lines += ["", f"First failure: rank {failure.rank}{where}:", "", f"    {failure.error}"]
    elif result.unchecked:
        first = min(result.unchecked, key=lambda o: o.order)
        lines += ["", _not_checked(first)]
    else:
        lines += ["", "Every checked rank set up and ran one training step. Ranks not listed hold shards of the same"
                  " shapes as a listed rank of their stage."]
    return "\n".join(lines)


def _not_checked(first: RankOutcome) -> str:
    if first.status == "nostep":
        return (f"No failure, but rank {first.rank} ran no training step ({first.error}): only its setup was checked."
                " HINT: make the model's `train_dataloader` give at least one batch per rank, or drop it and let the"
                " check make token batches (`--seq-len`, `--micro-batch`).")
    where = f" in `{first.module}`" if first.module else ""
    return (f"No failure, but rank {first.rank} could not be checked to the end: its step reads a value computed from"
            f" the weights{where} ({first.error}), which a fake tensor does not have; what ran before it was checked."
            " HINT: run a few steps of the layout on a small world (fewer layers, the same dims) for the rest.")
