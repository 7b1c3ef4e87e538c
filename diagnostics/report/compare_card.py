"""The sweep's comparison as a markdown table (printed, ``compare.md``, and a TensorBoard text card) and as JSON
(``compare.json``), written into the sweep's folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diagnostics.analysis.compare import Comparison, Row
from diagnostics.analysis.memory import human_bytes
from diagnostics.records.codec import to_dict

CARD_TAG = "diagnostics/compare"
COLUMNS = ("run", "layout", "status", "global batch", "tokens/s", "step (measured)", "step (predicted)",
           "peak memory per rank", "peak (predicted)", "bottleneck", "first loss", "final loss")
OUTCOME = {"ok": "ok", "refused": "REFUSED", "oom": "OUT OF MEMORY", "hang": "HANG", "crash": "CRASH"}


def _bytes(count: float | None) -> str:
    return human_bytes(count) if count is not None else "-"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.3g} ms" if value < 10 else f"{value:.1f} s"


def _cells(row: Row, best: Row | None) -> tuple[str, ...]:
    r = row.record
    name = row.name + (f": {' '.join(row.varied)}" if row.varied else "")
    name = f"**{name}**" if row is best else name
    if row.status != "ok" or r is None:
        said = " ".join(f"{OUTCOME.get(row.status, row.status)}: {row.reason}".split()).replace("|", "\\|")
        return (name, f"`{row.layout}`", said,
                *("-",) * (len(COLUMNS) - 3))
    ratio = f" ({row.step_ratio:.2g}x)" if row.step_ratio is not None else ""
    peaks = " / ".join(_bytes(value) for value in r.peak_bytes) if r.peak_bytes else "-"
    kind = " RSS" if r.memory_kind == "peak_rss" and r.peak_bytes else ""
    memory_ratio = f" ({row.memory_ratio:.2g}x)" if row.memory_ratio is not None else ""
    batch = "-" if r.global_batch is None else str(r.global_batch)
    if row.other_batch is not None:
        batch = f"**{batch} (best: {row.other_batch})**"
    return (name, f"`{row.layout}`", "ok", batch, f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-",
            _seconds(r.step_s), _seconds(r.predicted_step_s) + ratio, peaks + kind,
            _bytes(r.predicted_peak_bytes) + memory_ratio, r.bottleneck or "-", _loss(r.first_loss),
            _loss(r.final_loss))


def _loss(value: float | None) -> str:
    return f"{value:.4g}" if value is not None else "-"


def verdict_line(comparison: Comparison) -> str:
    best, second = comparison.best, comparison.runner_up
    if best is None:
        return "No best layout: no run was measured."
    line = f"Best: `{best.layout}` (run {best.name}), {best.tokens_per_s:,.0f} tokens/s"
    if second is not None and comparison.margin is not None:
        line += f", {comparison.margin:.1%} ahead of `{second.layout}` (run {second.name}, {second.tokens_per_s:,.0f})"
    return line + "."


def repeat_line(row: Row) -> str:
    """The best run's own overrides (Hydra's settings left out): the line that runs it again."""
    kept = [o for o in row.overrides if not o.lstrip("+~").startswith("hydra.")]
    return " ".join(kept)


def compare_markdown(comparison: Comparison, folder: str) -> str:
    lines = [f"### Sweep comparison: {folder}", "", verdict_line(comparison)]
    if comparison.best is not None and comparison.best.overrides:
        lines += ["", f"Its overrides: `{repeat_line(comparison.best)}`"]
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(row, comparison.best)) + " |" for row in comparison.rows]
    failed = sum(row.status != "ok" for row in comparison.rows)
    lines += ["", f"{len(comparison.rows)} runs, {failed} failed. Global batch: samples per optimizer step (in bold:"
              " not the best's, so its losses do not compare with the best's). Tokens/s: over the batch ranks, steps"
              " after the first. Predicted: the planner's cost model for the run's layout and first batch (in brackets:"
              " predicted / measured; memory only where both count the CUDA allocator's peak, a CPU run measures"
              " its process's resident set, runtime included)."]
    priced = sorted({row.record.hardware for row in comparison.rows if row.record is not None
                     and row.record.predicted_step_s is not None and row.record.hardware})
    if priced:
        lines += ["", f"Predicted steps priced by: {'; '.join(priced)}."]
    lines += [f"- {note}" for note in comparison.notes]
    return "\n".join(lines) + "\n"


def compare_json(comparison: Comparison) -> dict[str, Any]:
    def row(r: Row) -> dict[str, Any]:
        return {"name": r.name, "layout": r.layout, "status": r.status, "reason": r.reason,
                "overrides": list(r.overrides), "step_ratio": r.step_ratio, "memory_ratio": r.memory_ratio,
                "global_batch_differs": r.other_batch is not None,
                "record": to_dict(r.record) if r.record is not None else None}

    return {"rows": [row(r) for r in comparison.rows], "best": comparison.best.name if comparison.best else None,
            "runner_up": comparison.runner_up.name if comparison.runner_up else None, "margin": comparison.margin,
            "best_overrides": repeat_line(comparison.best) if comparison.best else None,
            "notes": list(comparison.notes)}


def write_tensorboard_card(folder: Path, markdown: str) -> None:
    """The table as a text card in ``folder`` (a TensorBoard log dir of its own, beside the runs' ones)."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(folder)) as writer:
        writer.add_text(CARD_TAG, markdown, global_step=0)


MARKDOWN_FILE, JSON_FILE, CARD_DIR = "compare.md", "compare.json", "compare"


def write_comparison(folder: Path, comparison: Comparison, tensorboard: bool = True) -> str:
    """``compare.md``, ``compare.json`` and (``tensorboard``) the card in ``compare/``, all in ``folder``; returns
    the markdown."""
    markdown = compare_markdown(comparison, str(folder))
    (folder / MARKDOWN_FILE).write_text(markdown)
    (folder / JSON_FILE).write_text(json.dumps(compare_json(comparison), indent=1) + "\n")
    if tensorboard:
        write_tensorboard_card(folder / CARD_DIR, markdown)
    return markdown
