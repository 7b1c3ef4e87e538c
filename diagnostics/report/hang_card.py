"""The hang verdict as a markdown card (TensorBoard) and as console lines (every rank)."""

from __future__ import annotations

from diagnostics.records import HangReport

ADVICE = {
    "stuck": "Its main thread is not in a collective: look at that line (a loop, a sleep, I/O, a lock, a data loader).",
    "skipped": "A collective inside a condition that is false on this rank only: make every rank of the group call it.",
    "mismatch": "Ranks of one group called different collectives or sizes at the same point: the shapes depend on"
                " the rank's data (uneven last batch, padding, a rank-dependent branch). Set"
                " `CollectiveMonitor(distributed_debug=\"DETAIL\")` to stop at the first such call.",
    "dead": "The process died (killed, crashed or out of memory): see its log, the kernel's (`dmesg`: the OOM"
            " killer) and, for an abort, `rank<R>/faulthandler.txt`; resume from the last checkpoint.",
    "no_capture": "The rank left no capture in time: see its log; it may still be running (a stuck host) or gone.",
    "failed": "The rank raised by itself: its own traceback (its log) is the cause; the others only waited for it.",
    "never_sent": "A pipeline stage skipped a send its neighbour waits for: a rank-dependent branch in the stage,"
                  " or microbatches that differ between stages.",
    "never_received": "A stage sent what its neighbour never asked for: the stages disagree on the schedule.",
}


def hang_markdown(report: HangReport, folder: str) -> str:
    lines = ["**Hang / failure verdict**", "", f"Reason given: {report.reason or '-'}", ""]
    lines += [f"- {sentence}" for sentence in report.summary] or ["- no culprit found in the captures"]
    lines += ["", "| rank | what | dim | group | op | # | where | peers waited (s) |", "|---|" * 8]
    for c in report.culprits:
        seq, waited = c.seq if c.seq is not None else "-", c.waited_s if c.waited_s is not None else "-"
        lines.append(f"| {c.rank} | {c.kind} | {c.dim} | {list(c.group_ranks)} | {c.op} | {seq} | {c.frame or '-'}"
                     f" | {waited} |")
    lines += ["", "| what to do |", "|---|"]
    lines += [f"| {ADVICE[kind]} |" for kind in dict.fromkeys(c.kind for c in report.culprits) if kind in ADVICE]
    lines += ["", f"Captured ranks: {list(report.captured)}; without a capture: {list(report.missing)}."
              f" Files: `{folder}` (`hang.json`, `rank<R>/`, `fr/` for torch's `fr_trace`)."]
    return "\n".join(lines)


def hang_text(report: HangReport, folder: str) -> str:
    head = "lightning-nd diagnostics: hang verdict"
    body = [f"  {sentence}" for sentence in report.summary] or ["  no culprit found in the captures"]
    return "\n".join([head, *body, f"  (captured ranks {list(report.captured)}; files in {folder})"])
