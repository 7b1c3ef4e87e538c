"""The one JSON codec (`diagnostics/records/codec.py`) on the files earlier versions wrote (`tests/data/records/`,
made as SOURCES.md there says): each reads back through the path the monitors and the CLI use, holds exactly the
types its fields declare, and writes back the very text it was read from (the bottleneck windows: that text with
the fields added since at their defaults); the NCCL records of every log in
`tests/data/nccl` survive the round trip; what reading forgives, and what it refuses."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import pytest

from diagnostics.analysis.hang import hang_report
from diagnostics.analysis.nccl_log import parse_nccl_dir
from diagnostics.records import (
    CollectiveEntry,
    HangReport,
    MemoryReport,
    NcclRankLog,
    RankCapture,
    WindowContext,
    WindowRecord,
    from_dict,
    from_json,
    read_captures,
    read_windows,
    to_dict,
    to_json,
)
from diagnostics.report.memory_card import memory_card

DATA = Path(__file__).resolve().parents[1] / "data"
RECORDS = DATA / "records"
HANGS = {"hang_pp2_dp2": {"dead": ()}, "hang_failed_by_itself": {"dead": (3,)}}
"""The hang_report arguments each recorded verdict was made with (world size 4, the captures' reason)."""


def mismatches(hint: Any, value: Any, where: str = "") -> list[str]:
    """Where ``value`` is not what the field type ``hint`` declares (a list for a tuple, a str key for an int...)."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return []
    if origin is Union or origin is types.UnionType:
        found = [mismatches(kind, value, where) for kind in args]
        return [] if any(not f for f in found) else [f"{where}: {value!r} is none of {hint}"]
    if hint is type(None):
        return [] if value is None else [f"{where}: {value!r} is not None"]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if type(value) is not hint:
            return [f"{where}: {type(value).__name__} is not {hint.__name__}"]
        return [m for name, kind in get_type_hints(hint).items() for m in mismatches(kind, getattr(value, name),
                                                                                    f"{where}.{name}")]
    if origin in (tuple, list, dict):
        if type(value) is not origin:
            return [f"{where}: {type(value).__name__} is not {origin.__name__}"]
        if origin is dict:
            return [m for key, item in value.items() for kind, part in zip(args, (key, item))
                    for m in mismatches(kind, part, f"{where}[{key!r}]")]
        kinds = [args[0]] * len(value) if origin is list or args[1:] == (Ellipsis,) else list(args)
        if len(kinds) != len(value):
            return [f"{where}: {len(value)} items, not {len(kinds)}"]
        return [m for i, (kind, item) in enumerate(zip(kinds, value)) for m in mismatches(kind, item, f"{where}[{i}]")]
    if origin is Literal:
        return [] if value in args else [f"{where}: {value!r} not in {args}"]
    if hint is float and type(value) is int:
        return []
    return [] if type(value) is hint else [f"{where}: {value!r} is not {hint.__name__}"]


def _capture_files() -> list[Path]:
    return sorted(RECORDS.glob("hang_*/rank*/capture.json"))


@pytest.mark.parametrize("path", _capture_files(), ids=lambda p: f"{p.parts[-3]}/{p.parts[-2]}")
def test_each_capture_reads_back_typed_and_writes_back_the_same_line(path):
    capture = read_captures(path.parents[1])[int(path.parent.name.removeprefix("rank"))]
    assert mismatches(RankCapture, capture) == []
    assert to_json(capture, indent=None) == path.read_text()  # as `CaptureExchange.publish` writes it


@pytest.mark.parametrize("scenario", sorted(HANGS))
def test_each_hang_verdict_reads_back_and_is_what_the_captures_give_today(scenario):
    text = (RECORDS / scenario / "hang.json").read_text()
    report = from_json(HangReport, text)
    assert mismatches(HangReport, report) == []
    assert to_json(report) == text
    captures = read_captures(RECORDS / scenario)
    reason = next(iter(captures.values())).reason
    assert hang_report(captures, 4, HANGS[scenario]["dead"], reason=reason) == report


ADDED_SINCE = {"host_cores": {}, "shared_gpus": {}, "findings": [], "profiled": None}
"""Fields the bottleneck records gained after tests/data/records was written, with the value an old file reads as."""


def same_but_added(written: Any, original: Any, where: str = "") -> list[str]:
    """Where ``written`` differs from ``original`` other than by the `ADDED_SINCE` fields at their defaults."""
    if isinstance(original, dict) and isinstance(written, dict):
        extra = [f"{where}.{key}={written[key]!r}" for key in written.keys() - original.keys()
                 if key not in ADDED_SINCE or written[key] != ADDED_SINCE[key]]
        missing = [f"{where}.{key} lost" for key in original.keys() - written.keys()]
        return extra + missing + [m for key in original.keys() & written.keys()
                                  for m in same_but_added(written[key], original[key], f"{where}.{key}")]
    if isinstance(original, list) and isinstance(written, list) and len(original) == len(written):
        return [m for i, (w, o) in enumerate(zip(written, original)) for m in same_but_added(w, o, f"{where}[{i}]")]
    return [] if written == original and type(written) is type(original) else [f"{where}: {original!r} -> {written!r}"]


def test_every_window_of_bottleneck_jsonl_reads_back_typed_and_writes_back_the_same_line():
    lines = (RECORDS / "bottleneck.jsonl").read_text().splitlines()
    windows = read_windows("\n".join(lines))
    assert len(windows) == len(lines) == 8
    for window, line in zip(windows, lines):
        assert mismatches(WindowRecord, window) == []
        assert same_but_added(json.loads(to_json(window, indent=None)), json.loads(line)) == []
        assert read_windows(to_json(window, indent=None)) == [window]
    assert same_but_added({"a": 1, "findings": ["x"]}, {"a": 1}) and same_but_added({"b": 1}, {"a": 1})
    assert windows[-1].context.hosts == {0: "node-a", 1: "node-a", 2: "node-b"}  # int keys again, as written


@pytest.mark.parametrize("path", sorted(RECORDS.glob("memory/*.json")), ids=lambda p: p.name)
def test_each_memory_report_reads_back_typed_and_writes_back_the_same_text(path):
    report = from_json(MemoryReport, path.read_text())
    assert mismatches(MemoryReport, report) == []
    assert to_json(report) == path.read_text()
    assert f"rank {report.rank}" in memory_card(report)


def test_a_dropped_key_is_seen_the_text_no_longer_round_trips():
    line = (RECORDS / "hang_pp2_dp2" / "rank0" / "capture.json").read_text()
    values = json.loads(line)
    del values["entries"][0]["frames"]  # it has a default: reading forgives it, writing shows it
    assert to_json(from_dict(RankCapture, values), indent=None) != line


def test_every_nccl_log_in_the_corpus_survives_the_round_trip():
    logs = [log for scenario in sorted((DATA / "nccl").iterdir()) if scenario.is_dir()
            for log in parse_nccl_dir(scenario)]
    assert len(logs) > 30 and any(comm.connections for log in logs for comm in log.comms.values())
    for log in logs:
        again = from_json(NcclRankLog, to_json(log))
        assert again == log and mismatches(NcclRankLog, again) == []


def test_reading_forgives_unknown_and_defaulted_keys_and_refuses_missing_and_misshapen_ones():
    entry = {"group": "1", "seq": "7", "op": "all_reduce", "input_sizes": [[4, 8]], "input_dtypes": ["Float"],
             "retired": True, "a_later_field": 1}
    read = from_dict(CollectiveEntry, entry)  # no started_ns (may be None), no frames (default), an unknown key
    assert read == CollectiveEntry("1", 7, "all_reduce", ((4, 8),), ("Float",), True, None, ())
    with pytest.raises(KeyError, match="retired"):
        from_dict(CollectiveEntry, {k: v for k, v in entry.items() if k != "retired"})
    with pytest.raises(TypeError, match="WindowContext"):
        from_dict(WindowContext, ["not", "an", "object"])
    with pytest.raises(ValueError):
        from_dict(CollectiveEntry, {**entry, "seq": "seven"})
    assert from_dict(MemoryReport, {k: v for k, v in to_dict(MemoryReport(0, 1, 0, "cpu", None, None, (), ())).items()
                                    if k not in ("dims", "options", "step")}).step is None
