"""Each optimizer step's phases on this rank, from the strategy's `StepPhase` and `StageTiming` events.

A step runs from the end of the previous one (the monitor's ``on_train_batch_end`` after an optimizer step) to its
own end, so steps tile the run. A phase is counted from the step's start at the earliest: the strategy's
``data_wait`` begins when the previous optimizer step ends, a little before that step's hooks have run. A phase
inside another (under manual optimization ``backward`` and ``optimizer`` run inside ``forward``) is taken out of
the outer one. What no phase covers (Lightning's hooks, logging, the batch's transfer) is ``host``. Under pp the
microbatches' forward, backward and backward_weight add up per phase, and the stage's idle time inside the
schedule is ``pipeline_idle``. Validation loops and checkpoint saves are `exclude`d, from the step and from any
phase they overlap (the strategy's ``data_wait`` spans them): they are not a step's.
"""

from __future__ import annotations

from typing import Any

LIVE_PHASES = ("data_wait", "forward", "backward", "optimizer", "pipeline_idle", "host")


def _overlap(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in intervals)


class StepClock:
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        """One per closed step: ``step_s`` and every key of `LIVE_PHASES`, in seconds."""
        self._start: float | None = None
        self._excluded: list[tuple[float, float]] = []
        self._spans: list[tuple[str, float, float]] = []
        self._idle = 0.0

    def begin(self, now: float) -> None:
        self._start, self._excluded, self._spans, self._idle = now, [], [], 0.0

    def exclude(self, start: float, end: float) -> None:
        """``[start, end]`` (``time.perf_counter``) is not the step's: a validation loop, a checkpoint save."""
        self._excluded.append((start, end))

    def phase(self, event: Any) -> None:
        if self._start is not None:
            name = "backward" if event.phase == "backward_weight" else event.phase
            self._spans.append((name, max(event.start_s, self._start), event.start_s + event.duration_s))

    def stage(self, event: Any) -> None:
        if self._start is not None:
            self._idle += event.idle_s

    def close(self, now: float) -> dict[str, float] | None:
        """End the running step at ``now`` (and begin the next); its row, or None before the first `begin`."""
        if self._start is None:
            self.begin(now)
            return None
        row = dict.fromkeys(LIVE_PHASES, 0.0)
        for (name, _, _), seconds in zip(self._spans, self._net()):
            row[name] += max(seconds, 0.0)
        row["pipeline_idle"] += self._idle
        step = now - self._start - _overlap(self._start, now, self._excluded)
        row["host"] = max(step - sum(row.values()), 0.0)
        row["step_s"] = step
        self.rows.append(row)
        self.begin(now)
        return row

    def _net(self) -> list[float]:
        """Each span's time less the excluded intervals and the spans directly inside it (one pass, sorted)."""
        spans = self._spans
        net = [end - start - _overlap(start, end, self._excluded) for _, start, end in spans]
        parents: list[int] = []
        for i in sorted(range(len(spans)), key=lambda i: (spans[i][1], -spans[i][2])):
            _, start, end = spans[i]
            while parents and spans[parents[-1]][2] < end:
                parents.pop()
            if parents and spans[parents[-1]][1:] != (start, end):
                net[parents[-1]] -= end - start - _overlap(start, end, self._excluded)
            parents.append(i)
        return net

    def take(self) -> list[dict[str, float]]:
        """The rows closed so far, forgotten here."""
        rows, self.rows = self.rows, []
        return rows


def mean_row(rows: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each key over ``rows`` (at least one)."""
    return {key: sum(row[key] for row in rows) / len(rows) for key in rows[0]}
