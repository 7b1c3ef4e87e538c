"""The NCCL card: findings with their fix, then what each rank and each communicator's log says (TensorBoard
markdown, and aligned text for the console of ``python -m diagnostics nccl``)."""

from __future__ import annotations

from diagnostics.analysis.nccl_findings import NcclFinding, format_ranks
from diagnostics.records import NcclRankLog

FINDING_COLUMNS = ("severity", "finding", "ranks", "advice")
RANK_COLUMNS = ("rank", "host", "pid", "NCCL", "CUDA (build)", "CUDA (driver)", "network", "init complete")
NO_FINDINGS = ("No findings: every communicator finished init, the NCCL versions that were logged agree and no"
               " variable disables a transport.")
COMM_COLUMNS = ("communicator", "role", "ranks", "nRanks", "nodes", "channels", "transports", "NVLS", "init complete")


def _rank_rows(logs: list[NcclRankLog]) -> list[tuple[str, ...]]:
    rows = []
    for log in logs:
        done = sum(c.init_complete for c in log.comms.values())
        rows.append((
            "?" if log.global_rank is None else str(log.global_rank), ", ".join(log.hosts) or "?",
            ", ".join(map(str, log.pids)) or "?", log.nccl_version or "not logged", log.cuda_version or "-",
            log.cuda_driver_version or "-", ", ".join(log.networks) or "-",
            f"{done}/{len(log.comms)} communicators"))
    return rows


def _version_note(logs: list[NcclRankLog]) -> list[str]:
    if all(log.nccl_version for log in logs):
        return []
    return ["", "NCCL <= 2.21 writes its version only into the log of a process that is rank 0 of some communicator"
                " (src/init.cc `showVersion`): \"not logged\" elsewhere is expected."]


def _comm_rows(topology: list[dict]) -> list[tuple[str, ...]]:
    return [(row["communicator"], row["role"] or "-", format_ranks(row["ranks"]), str(row["n_ranks"] or "?"),
             str(row["n_nodes"]), str(row["channels"] or "?"), ", ".join(row["transports"]) or "not logged",
             "yes" if row["nvls"] else "no", row["init_complete"]) for row in topology]


def _finding_rows(findings: list[NcclFinding]) -> list[tuple[str, ...]]:
    return [(f.severity, f"**{f.title}**: {f.detail}", format_ranks(f.ranks), f.advice) for f in findings]


def _markdown_table(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]


def _text_table(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [columns, *rows]]


def nccl_markdown(logs: list[NcclRankLog], findings: list[NcclFinding], topology: list[dict]) -> str:
    """Three tables: the findings (severity, finding, ranks, advice), the ranks, the communicators."""
    lines = ["**NCCL findings**", ""]
    lines += _markdown_table(FINDING_COLUMNS, _finding_rows(findings)) if findings else [NO_FINDINGS]
    lines += ["", "**Ranks**", "", *_markdown_table(RANK_COLUMNS, _rank_rows(logs)), *_version_note(logs)]
    lines += ["", "**Communicators** (one per process group; ranks are global)", "",
              *_markdown_table(COMM_COLUMNS, _comm_rows(topology))]
    return "\n".join(lines)


def nccl_text(logs: list[NcclRankLog], findings: list[NcclFinding], topology: list[dict]) -> str:
    """The same report for a terminal: findings as blocks (their advice is long), the tables aligned."""
    lines = [f"NCCL logs of {len(logs)} rank(s): {len(findings)} finding(s)"]
    for f in findings:
        lines += ["", f"{f.severity.upper()}: {f.title} [ranks {format_ranks(f.ranks)}]", f"  {f.detail}",
                  f"  fix: {f.advice}"]
    if not findings:
        lines.append(NO_FINDINGS)
    lines += ["", "Ranks", *_text_table(RANK_COLUMNS, _rank_rows(logs)), *_version_note(logs)]
    lines += ["", "Communicators (one per process group; ranks are global)",
              *_text_table(COMM_COLUMNS, _comm_rows(topology))]
    return "\n".join(lines)
