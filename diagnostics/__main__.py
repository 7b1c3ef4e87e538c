"""Offline diagnostics of a finished (or hung) run, from the files it left behind.

    python -m diagnostics nccl LOGDIR [--layout PATH]
    python -m diagnostics hang DUMPDIR
    python -m diagnostics trace DIR [--layout PATH] [--json]
    python -m diagnostics compare DIR [--json] [--no-tensorboard]

``nccl``: the NCCL INFO logs the diagnostics callback asks NCCL to write (``<log_dir>/diagnostics/nccl/
nccl.rank<R>.<host>.<pid>.log``): findings with their fix, then the ranks and communicators. Exit status:
0 report printed, 1 the report has errors, 2 nothing to read (the message says what was looked for).

Every subcommand reads files that may come from anywhere (`diagnostics.records.bounds`): one it cannot read ends in
one line naming it, exit status 2, never a traceback.

``hang``: the captures every live rank wrote when the run failed (``<dir>/diagnostics/rank<R>/capture.json``), or
flight-recorder dumps alone (``fr/fr_rank_<R>``, torch's own from an NCCL run too): the same verdict the run
printed. Exit status: 0 no culprit found, 1 culprits named, 2 nothing to read.

``trace``: `torch.profiler` traces, one Kineto JSON (or ``.json.gz``) per rank (gloo CPU traces and NCCL GPU traces;
the `BottleneckMonitor` keeps its last profiled step in ``<log_dir>/diagnostics/traces``): each rank's phases and
exposed communication per mesh role, classified as the live monitor does, with advice. Exit status: 0 printed,
2 nothing to read.

``compare``: a sweep's folder (Hydra's ``multirun/<date>/<time>``, or any folder of runs): one row per run with
its layout, tokens per second over the batch ranks, each rank's peak memory, the bottleneck class and final loss,
the planner's step time and peak beside the measured; failures as rows with their reason (refused, out of memory,
hang, crash). Names the best layout and its margin over the runner-up; writes ``compare.md``, ``compare.json`` and
a TensorBoard card (``compare/``) into DIR. Exit status: 0 a best layout named, 1 none (every run failed), 2 no
run found.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from diagnostics.analysis.nccl_findings import nccl_findings, topology_table
from diagnostics.analysis.nccl_log import parse_nccl_dir
from diagnostics.records import NcclRankLog
from diagnostics.records.bounds import read_json
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


def _from_layout(layout: str | None, starts: list[Path], what: str, read):
    """``read`` of ``--layout``, else of the first ``layout.json`` in ``starts`` or up to two levels above them;
    None when there is none (the run's log dir holds it; the monitor copies it into ``diagnostics/``)."""
    places = [p / LAYOUT_FILE for start in starts for p in (start, *list(start.parents)[:2])]
    path = Path(layout) if layout else next((p for p in places if p.is_file()), None)
    if path is None:
        return None
    try:
        value = read(read_json(path))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise _Unusable(f"cannot read {what} from {path} ({type(error).__name__}: {error}); pass"
                        f" `--layout` the run's {LAYOUT_FILE} (written into the run's log dir)") from error
    print(f"{what} from {path}", file=sys.stderr)
    return value


def _roles(layout: str | None, folder: Path, logs: list[NcclRankLog]) -> dict[str, list[list[int]]] | None:
    """The mesh roles, looked for beside LOGDIR and beside the logs."""
    log_dir = Path(logs[0].path).resolve().parent if logs and logs[0].path else folder
    return _from_layout(layout, [folder, log_dir], "mesh roles", lambda values: values["roles"])


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
    """Every rank's mesh coordinates: what a dump alone lacks (without them pipeline stages would be compared)."""
    def read(values: dict) -> dict[str, dict[str, int]]:
        return {str(r["rank"]): dict(r["coordinates"]) for r in values["ranks"]}

    return _from_layout(layout, folders, "rank coordinates", read) or {}


def _captures(folders: list[Path], coordinates: dict[str, dict[str, int]]) -> dict:
    """The captures in the folders, and for ranks without one, a flight-recorder dump (``fr_rank_<R>``)."""
    from diagnostics.collect.flight_recorder import DUMP_PREFIX, capture_of_dump, load_dump
    from diagnostics.records import read_captures

    captures: dict = {}
    for folder in folders:
        captures.update(read_captures(folder))
    for path in (p for f in folders for p in (*f.glob(f"{DUMP_PREFIX}*"), *f.glob(f"fr/{DUMP_PREFIX}*"))):
        suffix = path.name.removeprefix(DUMP_PREFIX)
        if not suffix.isdigit() or int(suffix) in captures:
            continue
        elsewhere = f"move it out of {path.parent} to read the other ranks' dumps"
        try:
            dump = load_dump(path)
        except OSError as error:
            raise _Unusable(f"cannot read the flight-recorder dump {path}: {error}") from error
        except ValueError as error:  # a truncated, foreign or crafted file: say which, and read none of it
            raise _Unusable(f"{error}; {elsewhere}") from error
        try:
            captures[int(suffix)] = capture_of_dump(dump, int(suffix), len(coordinates), path.stat().st_mtime,
                                                    coordinates)
        except (AttributeError, KeyError, TypeError, ValueError) as error:  # plain data, but not shaped as a dump
            reason = f"{type(error).__name__}: {error}"
            raise _Unusable(f"{path} is not a flight-recorder dump ({reason}); {elsewhere}") from error
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
    dead = {int(m.group(1)) for c in captures.values() if (m := re.match(r"rank (\d{1,7}) died", c.reason))}
    report = hang_report(captures, world_size, dead, reason=next(iter(captures.values())).reason)
    print(hang_text(report, str(folders[-1])))
    return 1 if report.culprits else 0


def _trace(args: argparse.Namespace) -> int:
    from diagnostics.analysis.bottleneck import attribute_waiting, classify
    from diagnostics.analysis.trace import dims_from_trace, find_traces, rank_times, read_trace, trace_steps
    from diagnostics.records import WindowContext, WindowRecord, to_json
    from diagnostics.report.bottleneck_card import bottleneck_markdown

    given = Path(args.dir).resolve()
    folders = [f for f in (given, given / "diagnostics" / "traces", given / "traces") if f.is_dir()]
    if not folders:
        raise _Unusable(f"{given} is not a folder; pass a folder of torch.profiler traces (one `*.json` or"
                        " `*.json.gz` per rank) or a run's log dir (`diagnostics/traces`)")
    try:
        found = next((traces for folder in folders if (traces := _traces_in(folder, find_traces))), None)
        if found is None:
            raise _Unusable(f"no torch.profiler trace in {', '.join(map(str, folders))} (looked for `*.json` and"
                            " `*.json.gz` Kineto traces); export one per rank with `prof.export_chrome_trace(...)` or"
                            " `torch.profiler.tensorboard_trace_handler(dir)`")
        traces = {rank: [read_trace(path) for path in paths] for rank, paths in sorted(found.items())}
    except ValueError as error:
        raise _Unusable(str(error)) from error
    layout = _from_layout(args.layout, folders, "layout", dict) or {}
    dims = layout.get("dims") or dims_from_trace(next(iter(traces.values()))[0])
    steps = {rank: [step for trace in per_rank for step in trace_steps(trace, dims)] for rank, per_rank in traces.items()}
    ranks = [rank_times(rank_steps, rank) for rank, rank_steps in steps.items() if rank_steps]
    if not ranks:
        raise _Unusable(f"the traces under {given} hold no step (no main-thread events)")
    numbers = [s.step for rank_steps in steps.values() for s in rank_steps if s.step is not None] or [0]
    options = layout.get("options", {})
    context = WindowContext(first_step=min(numbers), last_step=max(numbers), dims=dims, roles=layout.get("roles", {}),
                            pp_schedule=options.get("pp_schedule"), pp_microbatches=options.get("pp_microbatches"),
                            pp_stages_per_rank=options.get("pp_stages_per_rank", 1), options=options)
    record = WindowRecord(context=context, ranks=attribute_waiting(ranks, context.roles),
                          diagnosis=classify(ranks, context))
    print(to_json(record) if args.json else bottleneck_markdown(record, profiled=True))
    return 0


def _traces_in(folder: Path, find_traces) -> dict:
    try:
        return find_traces(folder)
    except ValueError:
        return {}


def _compare(args: argparse.Namespace) -> int:
    from diagnostics.analysis.compare import compare
    from diagnostics.records import find_runs
    from diagnostics.report.compare_card import compare_json, write_comparison

    folder = Path(args.dir).resolve()
    if not folder.is_dir():
        raise _Unusable(f"{folder} is not a folder; pass a sweep's folder (Hydra's `multirun/<date>/<time>`)")
    runs = find_runs(folder)
    if not runs:
        raise _Unusable(f"no run under {folder} (looked for Hydra job folders, `.hydra/overrides.yaml`, and"
                        " `diagnostics/run.json`); run the sweep with `diagnostics.RunSummary` (the example's job"
                        " has it) and pass its folder")
    comparison = compare(runs)
    markdown = write_comparison(folder, comparison, tensorboard=not args.no_tensorboard)
    print(json.dumps(compare_json(comparison), indent=1) if args.json else markdown)
    return 0 if comparison.best is not None else 1


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
    trace = commands.add_parser("trace", help="phases, exposed communication per mesh role and the bottleneck, from"
                                              " torch.profiler traces (one per rank)")
    trace.add_argument("dir", help="a folder of Kineto traces, or a run's log dir (its diagnostics/traces)")
    trace.add_argument("--layout", help=f"the run's {LAYOUT_FILE}, for the mesh roles and pipeline options (default:"
                                        " found in DIR or up to two parents; else the dims from the traces)")
    trace.add_argument("--json", action="store_true", help="print the window record as JSON")
    trace.set_defaults(handler=_trace)
    compare = commands.add_parser("compare", help="one table of a sweep's runs, failures included, and the best layout")
    compare.add_argument("dir", help="the sweep's folder (Hydra's multirun/<date>/<time>), or any folder of runs")
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON")
    compare.add_argument("--no-tensorboard", action="store_true", help="write no TensorBoard card (compare/)")
    compare.set_defaults(handler=_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except _Unusable as error:
        print(f"python -m diagnostics {args.command}: {error}", file=sys.stderr)
        return 2
    except (Exception, RecursionError) as error:  # noqa: BLE001 - files from anywhere: one line, never a traceback
        where = next(getattr(args, name) for name in ("logdir", "dumpdir", "dir") if hasattr(args, name))
        print(f"python -m diagnostics {args.command}: the files under {where} hold what this cannot read"
              f" ({type(error).__name__}: {str(error)[:300]})", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
