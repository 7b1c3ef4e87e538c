"""The bottleneck window as markdown (the TensorBoard card ``diagnostics/bottleneck``), as one console line, and
as the per-rank step-phase figure (``diagnostics/step_phases``: one bar per rank, drawn with numpy alone)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from diagnostics.records import PHASES, RankTimes, WindowRecord

COLOURS = {"data_wait": (230, 159, 0), "forward": (0, 114, 178), "backward": (86, 180, 233),
           "optimizer": (0, 158, 115), "pipeline_idle": (204, 121, 167), "waiting": (213, 94, 0),
           "host": (140, 140, 140), "comm": (240, 228, 66)}
"""Okabe-Ito colours (told apart with any colour vision); every role's communication is yellow, darker per role."""
BAR_WIDTH, BAR_HEIGHT, GAP = 640, 18, 6


def _roles(ranks: Sequence[RankTimes]) -> list[str]:
    return sorted({role for r in ranks for role, seconds in r.comm.items() if seconds > 0})


def _colour(part: str, roles: list[str]) -> tuple[int, int, int]:
    if part in COLOURS:
        return COLOURS[part]
    shade = 1.0 - 0.45 * roles.index(part) / max(len(roles), 1)
    return tuple(int(c * shade) for c in COLOURS["comm"])  # type: ignore[return-value]


def _segments(rank: RankTimes, roles: list[str]) -> list[tuple[str, float]]:
    return [(p, rank.phases.get(p, 0.0)) for p in PHASES] + [(role, rank.comm.get(role, 0.0)) for role in roles]


def step_phase_image(ranks: Sequence[RankTimes]) -> np.ndarray:
    """[height, width, 3] uint8: one bar per rank (top: rank 0), its parts in step order, scaled to the slowest
    rank's step; the residual is left blank."""
    roles = _roles(ranks)
    longest = max((r.step_s for r in ranks), default=0.0) or 1.0
    image = np.full((GAP + len(ranks) * (BAR_HEIGHT + GAP), BAR_WIDTH, 3), 255, dtype=np.uint8)
    for row, rank in enumerate(ranks):
        top, left = GAP + row * (BAR_HEIGHT + GAP), 0.0
        for part, seconds in _segments(rank, roles):
            right = left + max(seconds, 0.0) / longest * BAR_WIDTH
            image[top:top + BAR_HEIGHT, int(round(left)):int(round(min(right, BAR_WIDTH)))] = _colour(part, roles)
            left = right
    return image


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
