"""The answer a sweep ends with: one row per run (a failure is a row with its reason, never a hole), ranked by
tokens per second over the batch ranks, the best layout and its margin over the runner-up, and the planner's
prediction beside each measurement. What the losses compare is said too: each row's global batch (a row whose
batch differs from the best's is flagged) and first-step loss (runs of one batch that started far apart are named).

Tokens per second over the batch ranks is the one throughput that compares layouts fairly: each layout trains
every token its batch ranks see, whatever the number of ranks that split one sample (tp, cp, pp).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from diagnostics.records.run import STATUSES, FoundRun, RunRecord

NOISE = 0.05
"""A margin below this is within what a shared machine's noise moves a short run's throughput."""
START_SPREAD = 0.10
"""First-step losses of one global batch further apart than this (relative) started from different models: plain
construction's spread over seeds is about 3% for the example GPT, 1% for the example Llama."""
DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
DEFAULTS = {"zero_stage": 3, "activation_checkpointing": "none"}
"""Options left out of a layout's name at these values (NDParallel's defaults)."""


@dataclass(frozen=True)
class Row:
    name: str
    """The run's folder under the sweep's."""
    layout: str
    """``pp=2,dp_shard=2 zero_stage=2``: the dims that are not 1 and the options that are not the defaults; the
    ``parallel`` overrides when the run was refused before it had a layout."""
    status: str
    reason: str
    overrides: tuple[str, ...]
    record: RunRecord | None
    varied: tuple[str, ...] = ()
    """Its overrides that not every run of the sweep shares: what the sweep varied."""
    other_batch: int | None = None
    """The best row's global batch, when this row trained another one (its losses do not compare with the best's)."""

    @property
    def global_batch(self) -> int | None:
        return self.record.global_batch if self.record is not None and self.status == "ok" else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.record.tokens_per_s if self.record is not None and self.status == "ok" else None

    @property
    def step_ratio(self) -> float | None:
        """Predicted over measured step time (1.0: exact)."""
        r = self.record
        if r is None or not r.predicted_step_s or not r.step_s:
            return None
        return r.predicted_step_s / r.step_s

    @property
    def memory_ratio(self) -> float | None:
        """Predicted over measured peak, where both count the same thing (the CUDA allocator's peak)."""
        r = self.record
        if r is None or r.memory_kind != "cuda_peak_allocated" or not r.predicted_peak_bytes or not r.peak:
            return None
        return r.predicted_peak_bytes / r.peak


@dataclass(frozen=True)
class Comparison:
    rows: tuple[Row, ...]
    """Runs that trained, fastest first, then the failures by name."""
    best: Row | None
    runner_up: Row | None
    margin: float | None
    """best / runner-up - 1 in tokens per second."""
    notes: tuple[str, ...]


def layout_name(record: RunRecord | None, overrides: tuple[str, ...]) -> str:
    if record is None or not record.dims:
        chosen = [o for o in overrides if o.lstrip("+~").startswith("parallel")]
        return " ".join(chosen) or "(default layout)"
    dims = ",".join(f"{d}={record.dims.get(d, 1)}" for d in DIM_ORDER if record.dims.get(d, 1) > 1 or d == "dp_shard")
    options = record.options
    batch_ranks = record.dims.get("dp_replicate", 1) * record.dims.get("dp_shard", 1)
    shown = [f"{k}={options[k]}" for k in ("activation_checkpointing",) if k in options and options[k] != DEFAULTS[k]]
    if batch_ranks > 1 and "zero_stage" in options and options["zero_stage"] != DEFAULTS["zero_stage"]:
        shown.insert(0, f"zero_stage={options['zero_stage']}")
    if record.dims.get("pp", 1) > 1:
        shown += [f"{k}={options[k]}" for k in ("pp_schedule", "pp_microbatches") if options.get(k) is not None]
    return " ".join([dims, *shown])


def row_of(run: FoundRun) -> Row:
    record = run.record
    if record is None:
        why = run.problem or ("it left no run record: killed before it could write one (a time limit, the"
                              " out-of-memory killer, a hang stopped from outside) or still running")
        return Row(run.name, layout_name(None, run.overrides), "crash", why, run.overrides, None)
    status = record.status if record.status in STATUSES else "crash"  # a record written by something else
    return Row(run.name, layout_name(record, run.overrides), status, record.reason, run.overrides, record)


def compare(runs: list[FoundRun]) -> Comparison:
    rows = [row_of(run) for run in runs]
    common = set.intersection(*(set(r.overrides) for r in rows)) if len(rows) > 1 else set()
    rows = [replace(r, varied=tuple(o for o in r.overrides if o not in common)) for r in rows]
    trained = sorted((r for r in rows if r.status == "ok"), key=lambda r: -(r.tokens_per_s or 0.0))
    failed = [r for r in rows if r.status != "ok"]
    notes: list[str] = []
    measured = [r for r in trained if r.tokens_per_s]
    best = measured[0] if measured else None
    runner_up = measured[1] if len(measured) > 1 else None
    margin = best.tokens_per_s / runner_up.tokens_per_s - 1 if best and runner_up else None  # type: ignore[operator]
    if not rows:
        notes.append("No run found: point it at a sweep's folder (Hydra's `multirun/<date>/<time>`).")
    elif best is None:
        notes.append("No run trained long enough to measure: every row failed or measured no step after the first."
                     " HINT: fix the first failure's cause, or run at least 3 steps (`trainer.max_steps=3`).")
    elif runner_up is None:
        notes.append("Only one run was measured: there is no runner-up to compare it with.")
    elif margin is not None and margin < NOISE:
        notes.append(f"The best leads by {margin:.1%}, within a shared machine's noise on short runs. HINT: rerun"
                     " the two with more steps (`trainer.max_steps`) before choosing.")
    if any(r.tokens_per_s is None for r in trained):
        notes.append("Some runs measured no step after the first (warm-up): their throughput is blank.")
    trained, batch_notes = _batches(trained, best)
    return Comparison(tuple(trained + failed), best, runner_up, margin, tuple(notes + batch_notes))


def _batches(trained: list[Row], best: Row | None) -> tuple[list[Row], list[str]]:
    """The rows, those of another global batch than the best's flagged; notes on what the losses compare."""
    notes = []
    batch = best.global_batch if best is not None else None
    if batch is not None:
        trained = [replace(r, other_batch=batch) if r.global_batch not in (None, batch) else r for r in trained]
    flagged = [r.name for r in trained if r.other_batch is not None]
    if flagged:
        notes.append(f"Runs {', '.join(flagged)} trained another global batch than the best ({batch} samples per step):"
                     " their losses and steps do not compare with its. HINT: give every run one global batch"
                     " (`parallel=search` holds one; otherwise scale `data.batch_size` by the batch ranks).")
    starts: dict[int, list[tuple[float, str]]] = {}
    for r in trained:
        first = r.record.first_loss if r.record is not None else None
        if r.global_batch is not None and first is not None:
            starts.setdefault(r.global_batch, []).append((first, r.name))
    for size, losses in sorted(starts.items()):
        (low, lowest), (high, highest) = min(losses), max(losses)
        if low > 0 and high > low * (1 + START_SPREAD):
            notes.append(f"Runs of global batch {size} started from first-step losses {low:.4g} (run {lowest}) to"
                         f" {high:.4g} (run {highest}): they trained different models, so their final losses say"
                         " nothing about the layouts. HINT: build and seed the model the same way in every run.")
    return trained, notes
