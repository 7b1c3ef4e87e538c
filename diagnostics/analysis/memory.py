"""The memory verdict from numbers already taken: the breakdown in a fixed order, the fixes ranked by what they
save, the part that outgrew its estimate, and the one line a person reads first.

Pure: the measuring is ``diagnostics.collect.memory``, the estimates come from the cost model as plain numbers.
"""

from __future__ import annotations

from diagnostics.records import KINDS, Advice, MemoryFigure, MemoryReport

PARTS = KINDS[:-1]


def human_bytes(count: float) -> str:
    """1024-based, as torch prints sizes: ``512 B``, ``2.0 GiB``. (``lightning_nd.layout.describe.human_bytes``
    imports torch through ``lightning_nd/__init__``, which ``diagnostics/analysis`` must not.)"""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def _sum_if_known(values: list[int | None]) -> int | None:
    return None if any(value is None for value in values) else sum(values)


def breakdown(measured: dict[str, int | None], expected: dict[str, int | None],
              sources: dict[str, str]) -> tuple[MemoryFigure, ...]:
    """One figure per kind in ``KINDS`` order, the total last. A total not given directly (the CUDA allocator's
    or the RSS) is the sum of the parts, and only when every part is known: a sum with holes would pass for a
    peak."""
    figures = [MemoryFigure(kind, measured.get(kind), expected.get(kind), sources.get(kind, "")) for kind in PARTS]
    measured_total = measured.get("total")
    if measured_total is None:
        measured_total = _sum_if_known([figure.measured_bytes for figure in figures])
        total_source = "sum of the parts" if measured_total is not None else "not every part is known"
    else:
        total_source = sources.get("total", "")
    expected_total = expected.get("total")
    if expected_total is None:
        expected_total = _sum_if_known([figure.expected_bytes for figure in figures])
    figures.append(MemoryFigure("total", measured_total, expected_total, total_source))
    return tuple(figures)


def rank_advice(current_peak: int, candidates: list[tuple[str, dict, int, str]]) -> tuple[Advice, ...]:
    """``candidates``: (action, change, predicted peak after, detail). Those that save something, largest saving
    first, ties by action so the order is the same on every rank."""
    advice = [Advice(action, dict(change), current_peak - peak_after, peak_after, detail)
              for action, change, peak_after, detail in candidates]
    return tuple(sorted((a for a in advice if a.saving_bytes > 0), key=lambda a: (-a.saving_bytes, a.action)))


def largest_gap(figures: tuple[MemoryFigure, ...]) -> MemoryFigure | None:
    """The part whose measurement exceeds its estimate the most (None when none does): what the cost model
    missed, so what the verdict names before anything else."""
    over = [f for f in figures if f.kind != "total" and f.measured_bytes is not None and f.expected_bytes is not None
            and f.measured_bytes > f.expected_bytes]
    return max(over, key=lambda f: (f.measured_bytes - f.expected_bytes, f.kind), default=None)


def largest_part(figures: tuple[MemoryFigure, ...]) -> MemoryFigure | None:
    """The biggest part, measured where it could be, else estimated (activations on CPU)."""
    sized = [f for f in figures if f.kind != "total" and _size(f) is not None]
    return max(sized, key=lambda f: (_size(f), f.kind), default=None)


def _size(figure: MemoryFigure) -> int | None:
    return figure.measured_bytes if figure.measured_bytes is not None else figure.expected_bytes


def _part_text(report: MemoryReport) -> str:
    capacity = report.capacity_bytes or (report.oom.capacity_bytes if report.oom else None)
    of = f" of {human_bytes(capacity)}" if capacity else ""
    gap = largest_gap(report.figures)
    if gap is not None:
        over = gap.measured_bytes - gap.expected_bytes
        return (f"{gap.kind} {human_bytes(gap.measured_bytes)}{of}, {human_bytes(over)} more than the"
                f" {human_bytes(gap.expected_bytes)} expected")
    part = largest_part(report.figures)
    if part is None:
        return "no part of the memory could be measured or estimated"
    estimated = " (estimated)" if part.measured_bytes is None else ""
    return f"{part.kind} {human_bytes(_size(part))}{estimated}{of}"


def verdict(report: MemoryReport) -> str:
    """``rank 3 ran out of memory at step 4 asking for 2.0 GiB: activations 61.2 GiB of 76.0 GiB; best fix:
    activation_checkpointing='full' saves 41.0 GiB``."""
    who = report.culprit if report.culprit is not None else report.rank
    step = f" at step {report.step}" if report.step is not None else ""
    requested = report.oom.requested_bytes if report.oom else None
    asking = f" asking for {human_bytes(requested)}" if requested is not None else ""
    if report.advice:
        best = report.advice[0]
        fix = f"best fix: {best.action} saves {human_bytes(best.saving_bytes)}"
    else:
        fix = "no candidate fix lowers the peak"
    return f"rank {who} ran out of memory{step}{asking}: {_part_text(report)}; {fix}"


__all__ = ["PARTS", "breakdown", "human_bytes", "largest_gap", "largest_part", "rank_advice", "verdict"]
