"""The memory verdict as a markdown card (TensorBoard) and as a few console lines."""

from __future__ import annotations

from diagnostics.analysis.memory import human_bytes, verdict
from diagnostics.records import Advice, MemoryFigure, MemoryReport, OomMessage

UNKNOWN_ON_CPU = "unknown (CPU keeps no allocator statistics)"
SUMMARY_ADVICE = 3


def _cell(text: str) -> str:
    """Table cells cannot hold a pipe or a line break."""
    return text.replace("|", "\\|").replace("\n", " ")


def _size(count: int | None, unknown: str = "-") -> str:
    return human_bytes(count) if count is not None else unknown


def _capacity(report: MemoryReport) -> int | None:
    return report.capacity_bytes or (report.oom.capacity_bytes if report.oom else None)


def _figure_row(figure: MemoryFigure, device: str) -> str:
    unknown = UNKNOWN_ON_CPU if device.startswith("cpu") else "unknown"
    name = f"**{figure.kind}**" if figure.kind == "total" else figure.kind
    return (f"| {name} | {_size(figure.measured_bytes, unknown)} | {_size(figure.expected_bytes)}"
            f" | {_cell(figure.source) or '-'} |")


def _oom_lines(oom: OomMessage | None) -> list[str]:
    if oom is None:
        return ["No out-of-memory message was left to read (the process may have been killed: see `dmesg`)."]
    if not oom.device:
        return ["The error was not an out-of-memory message torch prints:", "", f"> {oom.text}"]
    known = [("requested", oom.requested_bytes), ("capacity", oom.capacity_bytes), ("allowed", oom.allowed_bytes),
             ("free", oom.free_bytes), ("in use by this process", oom.process_in_use_bytes),
             ("allocated by PyTorch", oom.allocated_bytes),
             ("reserved but unallocated", oom.reserved_unallocated_bytes)]
    parts = [f"{name} {human_bytes(count)}" for name, count in known if count is not None]
    parts += [f"process {pid} {human_bytes(count)}" for pid, count in oom.other_processes]
    return [f"Out-of-memory message on `{oom.device}`: {', '.join(parts) or 'no sizes'}.", "", f"> {oom.text}"]


def _advice_row(number: int, advice: Advice, capacity: int | None) -> str:
    fits = "" if capacity is None else (" (fits)" if advice.peak_after_bytes <= capacity else " (still over)")
    return (f"| {number} | `{_cell(advice.action)}` | {human_bytes(advice.saving_bytes)}"
            f" | {human_bytes(advice.peak_after_bytes)}{fits} | {_cell(advice.detail)} |")


def memory_card(report: MemoryReport) -> str:
    lines = [f"**Out of memory: {verdict(report)}**", ""]
    lines += ["| | measured | expected | how measured |", "|---|---|---|---|"]
    lines += [_figure_row(figure, report.device) for figure in report.figures]
    lines += ["", *_oom_lines(report.oom), ""]
    if report.advice:
        capacity = _capacity(report)
        lines += ["| # | change | saves | peak after | why |", "|---|---|---|---|---|"]
        lines += [_advice_row(number, advice, capacity) for number, advice in enumerate(report.advice, 1)]
    else:
        lines.append("No candidate change lowers the predicted peak.")
    layout = ", ".join(f"{dim} {size}" for dim, size in report.dims.items()) or "-"
    options = ", ".join(f"{name}={value!r}" for name, value in report.options.items()) or "-"
    lines += ["", f"Layout: {layout}. Options: {options}."]
    if report.notes:
        lines += ["", *(f"- {note}" for note in report.notes)]
    return "\n".join(lines)


def memory_summary(report: MemoryReport) -> str:
    """The verdict and the best few fixes, for every rank's console."""
    body = [f"  {verdict(report)}"]
    body += [f"  {number}. {advice.action}: saves {human_bytes(advice.saving_bytes)},"
             f" peak {human_bytes(advice.peak_after_bytes)}"
             for number, advice in enumerate(report.advice[:SUMMARY_ADVICE], 1)]
    return "\n".join(["lightning-nd diagnostics: out of memory", *body])


__all__ = ["memory_card", "memory_summary"]
