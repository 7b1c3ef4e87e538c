"""One collective's measured times on one host and the line fitted to them: `CollectiveFit`, time = latency +
bytes / bandwidth (nccl-tests' doc/PERFORMANCE.md model), and the latency a small call has inside a step.
`HostProfile` (``profile.py``) holds one per collective and group size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LONGEST_LINK_S_PER_BYTE = 1e-15
"""The smallest seconds per byte a fit keeps (1 PB/s): above every link, so a fit whose times do not grow with the
size stays finite."""
SHORTEST_LATENCY_S = 1e-9


@dataclass(frozen=True)
class CollectiveFit:
    """One collective over groups of ``group_size`` ranks: time = ``latency_s`` + bytes / ``bytes_per_s``."""

    kind: str
    group_size: int
    latency_s: float
    bytes_per_s: float
    samples: tuple[tuple[int, float], ...]
    """(bytes, median seconds) as measured, smallest first: the points the line was fitted to."""
    in_step: tuple[tuple[float, float], ...] = ()
    """(seconds of work between calls, a small call's seconds) inside a step: called after that much work, the
    ranks never started together again (``micro_benchmarks._time_in_step``), fewest seconds of work first. Where
    ranks outnumber cores it is several times ``latency_s`` and grows with the work: a waiting rank gives its core
    up and waits for the scheduler."""

    @classmethod
    def fit(cls, kind: str, group_size: int, samples: list[tuple[int, float]],
            in_step: Sequence[tuple[float, float]] = ()) -> CollectiveFit:
        """Least squares of seconds on bytes over at least 3 sizes, each point weighted by 1 / seconds^2 (its
        relative error counts, so a 4 KiB message's 0.2 ms weighs as much as a 16 MiB one's 30 ms and the latency is
        not lost in the large sizes' noise). Both coefficients are kept positive: a negative intercept is refitted
        through ``SHORTEST_LATENCY_S``, a slope under ``LONGEST_LINK_S_PER_BYTE`` is clamped to it and the
        intercept refitted."""
        if len({size for size, _ in samples}) < 3 or min(t for _, t in samples) <= 0:
            raise ValueError(f"`{kind}` over {group_size} ranks was measured at {len(samples)} sizes. HINT: the fit"
                             " of latency and bandwidth needs at least 3 distinct message sizes, each of positive time.")
        points = [(float(size), seconds, seconds**-2) for size, seconds in samples]
        weight = sum(w for _, _, w in points)
        mean_size = sum(w * s for s, _, w in points) / weight
        mean_time = sum(w * t for _, t, w in points) / weight
        slope = (sum(w * (s - mean_size) * (t - mean_time) for s, t, w in points)
                 / sum(w * (s - mean_size) ** 2 for s, _, w in points))
        latency = mean_time - slope * mean_size
        if latency < SHORTEST_LATENCY_S:
            latency = SHORTEST_LATENCY_S
            slope = sum(w * s * (t - latency) for s, t, w in points) / sum(w * s * s for s, _, w in points)
        if slope < LONGEST_LINK_S_PER_BYTE:
            slope = LONGEST_LINK_S_PER_BYTE
            latency = max(SHORTEST_LATENCY_S, sum(w * (t - slope * s) for s, t, w in points) / weight)
        return cls(kind, group_size, latency, 1 / slope, tuple(sorted((int(s), float(t)) for s, t in samples)),
                   tuple(sorted((float(w), float(t)) for w, t in in_step)))

    def seconds(self, nbytes: float, work_s: float | None = None) -> float:
        """Latency + ``nbytes`` / bandwidth; ``work_s``: called inside a step after that much work, the latency
        `in_step_latency` gives."""
        return (self.latency_s if work_s is None else self.in_step_latency(work_s)) + nbytes / self.bytes_per_s

    def in_step_latency(self, work_s: float) -> float:
        """A small call's seconds after ``work_s`` of work, interpolated linearly between the measured points (the
        nearest one outside them), never below ``latency_s``; ``latency_s`` where none were measured."""
        if not self.in_step:
            return self.latency_s
        return max(self.latency_s, piecewise_linear(self.in_step, work_s))


def piecewise_linear(points: Sequence[tuple[float, float]], x: float) -> float:
    """The value at ``x`` of the line through ``points`` (sorted by x, at least one), interpolated linearly between
    the two around it; the nearest point's value outside them."""
    if x <= points[0][0] or len(points) == 1:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    upper = next(i for i, (px, _) in enumerate(points) if px >= x)
    (x0, y0), (x1, y1) = points[upper - 1], points[upper]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
