"""What one training run leaves for the comparison of a sweep (``run.json``): how it ended, the layout it ran, what
it measured, and what the planner predicted for it. Written by `diagnostics.RunSummary` at the end of fit (or on
its failure), and by the job itself when it failed before any Trainer existed (a layout refused at construction);
read by ``python -m diagnostics compare``."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from diagnostics.records.bounds import read_json, read_text
from diagnostics.records.codec import from_dict

STATUSES = ("ok", "refused", "oom", "hang", "crash")
"""``refused``: the library declined the layout or its input, with a HINT, before the first optimizer step;
``oom``: out of memory; ``hang``: a collective timed out (or the run stopped answering and was killed);
``crash``: any other failure."""


@dataclass(frozen=True)
class RunRecord:
    """One run of a sweep, as ``<log_dir>/diagnostics/run.json``."""

    status: str
    """One of `STATUSES`."""
    reason: str = ""
    """Why it failed: the error's type and its first line (with its HINT where it gave one); "" when it ran."""
    overrides: tuple[str, ...] = ()
    """The job's Hydra overrides: the row's name and the command line that repeats it."""
    dims: dict[str, int] = field(default_factory=dict)
    """The Layout's dim sizes (pp, dp_replicate, dp_shard, cp, tp, ep, world_size); empty when refused early."""
    options: dict[str, Any] = field(default_factory=dict)
    """The Layout's options that set its cost: zero_stage, activation_checkpointing, pp_schedule, ..."""
    steps: int = 0
    """Optimizer steps completed."""
    global_batch: int | None = None
    """Samples per optimizer step over all batch ranks (per-rank batch x batch ranks x accumulated batches)."""
    first_loss: float | None = None
    """The first optimizer step's loss (the model as it started, on the first batch)."""
    final_loss: float | None = None
    tokens_per_s: float | None = None
    """Tokens trained per second over all batch ranks, from the steps after the first (warm-up) one."""
    step_s: float | None = None
    """Measured wall time of one optimizer step: the median over the steps after the first."""
    peak_bytes: tuple[float, ...] = ()
    """Each rank's peak memory, by rank (`memory_kind` says what was measured)."""
    memory_kind: str = ""
    """``cuda_peak_allocated`` (the CUDA allocator's peak: what the planner predicts) or ``peak_rss`` (CPU: the
    process's resident set, which includes the Python and torch runtime the planner does not count)."""
    bottleneck: str | None = None
    """The label of the run's last bottleneck window (None: the BottleneckMonitor was off or saw no window)."""
    predicted_step_s: float | None = None
    predicted_peak_bytes: float | None = None
    """The planner's step time and highest per-rank peak for this layout and the first batch's shape."""
    hardware: str | None = None
    """What priced the predicted step: the cost model's hardware preset (``cpu``, ``h100``, ...) or a host's
    measured profile (``profile of <host> (measured <day>)``)."""

    @property
    def peak(self) -> float | None:
        return max(self.peak_bytes) if self.peak_bytes else None


RUN_FILE = "run.json"
"""The `RunRecord`, in ``<log_dir>/diagnostics/``."""
HYDRA_DIR = ".hydra"
MAX_OVERRIDES_BYTES = 1 << 20
"""What marks a Hydra job's output folder (``overrides.yaml`` inside it names the job)."""


@dataclass(frozen=True)
class FoundRun:
    """A run in a sweep's folder: where it is, its record (None: it left none, e.g. killed), its overrides."""

    folder: Path
    name: str
    """Its path under the sweep's folder (``3``, ``runs/1``)."""
    record: RunRecord | None
    overrides: tuple[str, ...]
    problem: str = ""
    """Why the record could not be read, when there is one that could not."""


def find_runs(folder: Path) -> list[FoundRun]:
    """Every run under ``folder``: each Hydra job folder (``.hydra/`` inside) that holds no other job (a layout
    search's own job holds its measured runs), and each ``diagnostics/run.json`` outside any job folder. By name,
    numbers in numeric order."""
    folder = Path(folder)
    jobs = {path.parent.parent for path in folder.rglob(f"{HYDRA_DIR}/overrides.yaml")}
    if (folder / HYDRA_DIR).is_dir():
        jobs.add(folder)
    leaves = {job for job in jobs if not any(other != job and job in other.parents for other in jobs)}
    records = sorted(folder.rglob(f"diagnostics/{RUN_FILE}"))
    owners: dict[Path, list[Path]] = {}
    for path in records:
        owner = next((p for p in path.parents if p in leaves), None)
        if owner is None and not any(p in jobs for p in path.parents):
            owner = path.parent.parent
        if owner is not None:
            owners.setdefault(owner, []).append(path)
    found = [_read(run, folder, owners.get(run, [])) for run in leaves | set(owners)]
    return sorted(found, key=lambda run: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", run.name)])


def _read(run: Path, sweep: Path, paths: list[Path]) -> FoundRun:
    name = run.relative_to(sweep).as_posix() if run != sweep else "."
    overrides: tuple[str, ...] = ()
    listed = run / HYDRA_DIR / "overrides.yaml"
    if listed.is_file():
        try:
            lines = yaml.safe_load(read_text(listed, MAX_OVERRIDES_BYTES)) or []
            if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
                raise ValueError("not a list of `key=value` strings")  # nested lists: an alias bomb grows in str()
            overrides = tuple(lines)
        except (OSError, ValueError, RecursionError, yaml.YAMLError) as error:
            return FoundRun(run, name, None, (), f"unreadable {listed}: {str(error)[:300]}")
    if not paths:
        return FoundRun(run, name, None, overrides)
    try:
        record = from_dict(RunRecord, read_json(paths[0]))
    except (OSError, ValueError, KeyError, TypeError) as error:
        return FoundRun(run, name, None, overrides, f"unreadable {paths[0]}: {type(error).__name__}: {error}")
    return FoundRun(run, name, record, record.overrides or overrides)
