"""Each optimizer step's phases on this rank, from the strategy's `StepPhase` and `StageTiming` events.

A step runs from the end of the previous one (the monitor's ``on_train_batch_end`` after an optimizer step) to its
own end, so steps tile the run. A phase is counted from the step's start at the earliest: the strategy's
``data_wait`` begins when the previous optimizer step ends, a little before that step's hooks have run. What no
phase covers (Lightning's hooks, logging, the batch's transfer) is ``host``. Under pp the microbatches' forward,
backward and backward_weight add up per phase, and the stage's idle time inside the schedule is
``pipeline_idle``. Validation loops and checkpoint saves between steps are `exclude`d: they are not a step's.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

LIVE_PHASES = ("data_wait", "forward", "backward", "optimizer", "pipeline_idle", "host")


class StepClock:
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        """One per closed step: ``step_s`` and every key of `LIVE_PHASES`, in seconds."""
        self._start: float | None = None
        self._excluded = 0.0
        self._phases: dict[str, float] = defaultdict(float)

    def begin(self, now: float) -> None:
        self._start, self._excluded = now, 0.0
        self._phases.clear()

    def exclude(self, seconds: float) -> None:
        """Time inside the running step that is not the step's (a validation loop, a checkpoint save)."""
        self._excluded += seconds

    def phase(self, event: Any) -> None:
        if self._start is None:
            return
        end = event.start_s + event.duration_s
        seconds = end - max(event.start_s, self._start)
        if seconds > 0:
            self._phases["backward" if event.phase == "backward_weight" else event.phase] += seconds

    def stage(self, event: Any) -> None:
        if self._start is not None:
            self._phases["pipeline_idle"] += event.idle_s

    def close(self, now: float) -> dict[str, float] | None:
        """End the running step at ``now`` (and begin the next); its row, or None before the first `begin`."""
        if self._start is None:
            self.begin(now)
            return None
        step = now - self._start - self._excluded
        row = {name: self._phases.get(name, 0.0) for name in LIVE_PHASES if name != "host"}
        row["host"] = max(step - sum(row.values()), 0.0)
        row["step_s"] = step
        self.rows.append(row)
        self.begin(now)
        return row

    def take(self) -> list[dict[str, float]]:
        """The rows closed so far, forgotten here."""
        rows, self.rows = self.rows, []
        return rows


def mean_row(rows: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each key over ``rows`` (at least one)."""
    return {key: sum(row[key] for row in rows) / len(rows) for key in rows[0]}
