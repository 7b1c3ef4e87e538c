"""The bottleneck window as markdown (the TensorBoard card ``diagnostics/bottleneck``), as one console line, and
as the per-rank step-phase figure (``diagnostics/step_phases``: one labelled bar per rank, drawn with matplotlib)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from diagnostics.records import PHASES, RankTimes, WindowRecord

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLOURS = {"data_wait": (230, 159, 0), "forward": (0, 114, 178), "backward": (86, 180, 233),
           "optimizer": (0, 158, 115), "pipeline_idle": (204, 121, 167), "waiting": (213, 94, 0),
           "host": (140, 140, 140), "comm": (240, 228, 66)}
"""Okabe-Ito colours (told apart with any colour vision); every role's communication is yellow, darker per role."""
NAMES = {"data_wait": "data wait", "pipeline_idle": "pipeline idle"}


def _roles(ranks: Sequence[RankTimes]) -> list[str]:
    return sorted({role for r in ranks for role, seconds in r.comm.items() if seconds > 0})


def _colour(part: str, roles: list[str]) -> tuple[int, int, int]:
    if part in COLOURS:
        return COLOURS[part]
    shade = 1.0 - 0.45 * roles.index(part) / max(len(roles), 1)
    return tuple(int(c * shade) for c in COLOURS["comm"])  # type: ignore[return-value]


def _segments(rank: RankTimes, roles: list[str]) -> list[tuple[str, float]]:
    return [(p, rank.phases.get(p, 0.0)) for p in PHASES] + [(role, rank.comm.get(role, 0.0)) for role in roles]


def step_phase_figure(ranks: Sequence[RankTimes]) -> Figure:
    """One horizontal bar per rank (``rank R`` on the y axis, rank 0 on top), its parts in step order, in
    milliseconds; a legend entry per phase and per role's communication present; the residual is left blank."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # imported when a window is drawn, not by the CLI
    from matplotlib.figure import Figure

    roles = _roles(ranks)
    figure = Figure(figsize=(8, 1.2 + 0.35 * len(ranks)), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    shown: set[str] = set()
    for row, rank in enumerate(ranks):
        left = 0.0
        for part, seconds in _segments(rank, roles):
            width = max(seconds, 0.0) * 1e3
            if width <= 0:
                continue
            label = None if part in shown else (NAMES.get(part, part) if part in COLOURS else f"comm {part}")
            shown.add(part)
            axes.barh(row, width, left=left, height=0.7, color=[c / 255 for c in _colour(part, roles)], label=label)
            left += width
    axes.set_yticks(range(len(ranks)), [f"rank {rank.rank}" for rank in ranks])
    axes.invert_yaxis()
    axes.set_xlabel("ms per step (mean over the window)")
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
    return figure


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def bottleneck_markdown(record: WindowRecord, profiled: bool) -> str:
    d, c = record.diagnosis, record.context
    culprit = d.dim or (f"rank {d.rank}, {d.phase}" if d.rank is not None else "")
    lines = [f"### Steps {c.first_step}-{c.last_step}: **{d.label}**" + (f" ({culprit})" if culprit else ""), "",
             d.evidence, "", *[f"**Shared host:** {finding}." for finding in d.findings], *([""] if d.findings else []),
             *[f"- {advice}" for advice in d.advice], ""]
    if c.tokens_per_s is not None:
        lines.append(f"Throughput: {c.tokens_per_s:,.0f} tokens/s over the batch ranks"
                     + (f", MFU {c.mfu:.1%}" if c.mfu is not None else "") + ".")
    roles = _roles(record.ranks)
    header = ["rank", "step ms", *PHASES, *[f"comm {role}" for role in roles], "residual"]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for r in record.ranks:
        cells = [str(r.rank), _ms(r.step_s), *[_ms(r.phases.get(p, 0.0)) for p in PHASES],
                 *[_ms(r.comm.get(role, 0.0)) for role in roles], _ms(r.residual_s)]
        lines.append("| " + " | ".join(cells) + " |")
    legend = ", ".join(f"{name} {'#%02x%02x%02x' % _colour(name, roles)}" for name in [*PHASES, *roles])
    lines += ["", f"Milliseconds per step, mean over the window. Figure `diagnostics/step_phases` colours: {legend}.",
              "Phases are timed every step; " + ("communication per role is split out by the window's profiled step."
                                                 if profiled else "communication is not split out (no profiled step).")]
    return "\n".join(lines)


def bottleneck_summary(record: WindowRecord) -> str:
    d = record.diagnosis
    shared = f"; shared host: {d.findings[0]}." if d.findings else ""
    return (f"lightning-nd bottleneck, steps {record.context.first_step}-{record.context.last_step}: {d.label}."
            f" {d.evidence}{shared} {d.advice[0] if d.advice else ''}").strip()
