"""Offline diagnostics of a finished (or hung) run, from the files it left behind.

    python -m diagnostics nccl LOGDIR [--layout PATH]
    python -m diagnostics hang DUMPDIR

``nccl``: the NCCL INFO logs the diagnostics callback asks NCCL to write (``<log_dir>/diagnostics/nccl/
nccl.rank<R>.<host>.<pid>.log``): findings with their fix, then the ranks and communicators. Exit status:
0 report printed, 1 the report has errors, 2 nothing to read (the message says what was looked for).

``hang``: the captures every live rank wrote when the run failed (``<dir>/diagnostics/rank<R>/capture.json``), or
flight-recorder dumps alone (``fr/fr_rank_<R>``, torch's own from an NCCL run too): the same verdict the run
printed. Exit status: 0 no culprit found, 1 culprits named, 2 nothing to read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from diagnostics.analysis.nccl_findings import nccl_findings, topology_table
from diagnostics.analysis.nccl_log import NcclRankLog, parse_nccl_dir
from diagnostics.report.nccl_card import nccl_text

LAYOUT_FILE = "layout.json"


class _Unusable(Exception):
    """Input that cannot be read; its message is the one line printed before exiting with 2."""


def _find_logs(folder: Path) -> list[NcclRankLog]:
    """The folder itself, then where the callback writes (``diagnostics/nccl``), then anywhere below."""
    for candidate, recursive in ((folder, False), (folder / "diagnostics" / "nccl", False), (folder, True)):
        if candidate.is_dir() and (logs := parse_nccl_dir(candidate, recursive=recursive)):
            return logs
    return []


def _roles(layout: str | None, folder: Path, logs: list[NcclRankLog]) -> dict[str, list[list[int]]] | None:
    """``roles`` of ``--layout``, else of the first ``layout.json`` in LOGDIR, the logs' folder or two levels up."""
    if layout is not None:
        path = Path(layout)
    else:
        log_dir = Path(logs[0].path).resolve().parent if logs and logs[0].path else folder
        places = [p for start in (folder, log_dir) for p in (start, *list(start.parents)[:2])]
        path = next((p / LAYOUT_FILE for p in places if (p / LAYOUT_FILE).is_file()), None)
        if path is None:
            return None
    try:
        roles = json.loads(path.read_text())["roles"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise _Unusable(f"cannot read mesh roles from {path} ({type(error).__name__}: {error}); pass"
                        f" `--layout` the run's {LAYOUT_FILE} (written into the run's log dir)") from error
    print(f"mesh roles from {path}", file=sys.stderr)
    return roles


def _nccl(args: argparse.Namespace) -> int:
    folder = Path(args.logdir).resolve()
    if not folder.is_dir():
        raise _Unusable(f"{folder} is not a folder; pass the run's log dir (its NCCL logs are in"
                        " `diagnostics/nccl/nccl.rank<R>.<host>.<pid>.log`) or the folder holding them")
    try:
        logs = _find_logs(folder)
    except OSError as error:
        raise _Unusable(f"cannot read the NCCL logs under {folder}: {error}") from error
    if not logs:
        raise _Unusable(f"no NCCL log in {folder}, {folder / 'diagnostics' / 'nccl'} or below (looked for `nccl*.log`"
                        " and `*.log` holding `NCCL INFO`); run with the NCCL diagnostics callback, or with"
                        " `NCCL_DEBUG=INFO NCCL_DEBUG_FILE=<dir>/nccl.rank<R>.%h.%p.log`, and pass that folder")
    roles = _roles(args.layout, folder, logs)
    findings = nccl_findings(logs, roles)
    print(nccl_text(logs, findings, topology_table(logs, roles)))
    return 1 if any(f.severity == "error" for f in findings) else 0


def _coordinates(layout: str | None, folders: list[Path]) -> dict[str, dict[str, int]]:
    """Every rank's mesh coordinates from ``--layout`` or the first ``layout.json`` in the folders or two parents up
    (what a dump alone lacks: without them pipeline stages would be compared with each other)."""
    places = [Path(layout)] if layout else [p / LAYOUT_FILE for f in folders for p in (f, *list(f.parents)[:2])]
    path = next((p for p in places if p.is_file()), None)
    if path is None:
        return {}
    try:
        return {str(r["rank"]): dict(r["coordinates"]) for r in json.loads(path.read_text())["ranks"]}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise _Unusable(f"cannot read rank coordinates from {path} ({type(error).__name__}: {error}); pass"
                        f" `--layout` the run's {LAYOUT_FILE}") from error


def _captures(folders: list[Path], coordinates: dict[str, dict[str, int]]) -> dict:
    """The captures in the folders, and for ranks without one, a flight-recorder dump (``fr_rank_<R>``)."""
    import pickle

    from diagnostics.collect.flight_recorder import DUMP_PREFIX, capture_of_dump
    from diagnostics.records import read_captures

    captures: dict = {}
    for folder in folders:
        captures.update(read_captures(folder))
    for path in (p for f in folders for p in (*f.glob(f"{DUMP_PREFIX}*"), *f.glob(f"fr/{DUMP_PREFIX}*"))):
        suffix = path.name.removeprefix(DUMP_PREFIX)
        if not suffix.isdigit() or int(suffix) in captures:
            continue
        try:
            dump = pickle.loads(path.read_bytes())
        except Exception as error:  # a truncated or foreign file: say which
            raise _Unusable(f"cannot read the flight-recorder dump {path}: {type(error).__name__}: {error}") from error
        captures[int(suffix)] = capture_of_dump(dump, int(suffix), len(coordinates), path.stat().st_mtime,
                                                coordinates)
    return captures


def _hang(args: argparse.Namespace) -> int:
    import re

    from diagnostics.analysis.hang import hang_report
    from diagnostics.report.hang_card import hang_text

    given = Path(args.dumpdir).resolve()
    folders = [f for f in (given, given / "diagnostics") if f.is_dir()]
    if not folders:
        raise _Unusable(f"{given} is not a folder; pass the run's diagnostics dir (`<dir>/diagnostics`, holding"
                        " `rank<R>/capture.json`) or a folder of flight-recorder dumps (`fr_rank_<R>`)")
    captures = _captures(folders, _coordinates(args.layout, folders))
    if not captures:
        raise _Unusable(f"no capture in {given} (looked for `rank<R>/capture.json` and `fr_rank_<R>` there, in"
                        " `diagnostics/` and `fr/`); pass the folder a `CollectiveMonitor` run wrote")
    world_size = max(max(c.world_size for c in captures.values()), max(captures) + 1)
    dead = {int(m.group(1)) for c in captures.values() if (m := re.match(r"rank (\d+) died", c.reason))}
    report = hang_report(captures, world_size, dead, reason=next(iter(captures.values())).reason)
    print(hang_text(report, str(folders[-1])))
    return 1 if report.culprits else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m diagnostics", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    nccl = commands.add_parser("nccl", help="findings and tables from a run's NCCL INFO logs")
    nccl.add_argument("logdir", help="the run's log dir, or a folder of nccl.rank<R>.<host>.<pid>.log files")
    nccl.add_argument("--layout", help=f"the run's {LAYOUT_FILE} (default: found in LOGDIR or up to two parents)")
    nccl.set_defaults(handler=_nccl)
    hang = commands.add_parser("hang", help="the hang verdict from the captures and dumps a failed run left")
    hang.add_argument("dumpdir", help="the run's diagnostics dir (or its parent), or a folder of fr_rank_<R> dumps")
    hang.add_argument("--layout", help=f"the run's {LAYOUT_FILE}, for the ranks' coordinates (default: found in"
                                       " DUMPDIR or up to two parents)")
    hang.set_defaults(handler=_hang)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except _Unusable as error:
        print(f"python -m diagnostics {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
