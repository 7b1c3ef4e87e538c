"""What the probes record, as plain dataclasses with JSON I/O: the contract between the live monitors, the files a
failed run leaves (``<log_dir>/diagnostics/``), ``tests/data`` and the offline CLI (``python -m diagnostics``).

Nothing here imports torch or Lightning: a record read back from disk is the same object the probe made.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

CAPTURE_FILE = "capture.json"
HANG_FILE = "hang.json"


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    name: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.name}"


@dataclass(frozen=True)
class CollectiveEntry:
    """One collective as the flight recorder saw it on one rank."""

    group: str
    """The process group's name (``'1'``), as in the Layout's process-group records."""
    seq: int
    """The group's collective sequence number (per group, counted by every member)."""
    op: str
    """``all_reduce``, ``all_gather_into_tensor``, ... (the backend prefix removed)."""
    input_sizes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    retired: bool
    """Completed on this rank (on gloo the only sign of completion: ``state`` stays ``scheduled``)."""
    started_ns: int | None
    """Wall clock (ns since the epoch) when the rank issued it."""
    frames: tuple[Frame, ...] = ()
    """Python frames, innermost first, down to the user's line."""


@dataclass(frozen=True)
class PointToPointRecord:
    """One send or receive from the strategy's ledger (the flight recorder misses them on gloo)."""

    op: str
    """send or recv."""
    peer: int
    role: str
    """pp or cp."""
    state: str
    """issued or completed."""
    step: int
    tag: str
    """Direction and microbatch under pp (``fwd/2``); empty for ring attention hops."""
    bytes: int
    time_s: float


@dataclass(frozen=True)
class GroupRecord:
    """A process group this rank belongs to, with its mesh role (``world`` for the default group)."""

    name: str
    desc: str
    role: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class RankCapture:
    """Everything one live rank wrote when the run failed."""

    rank: int
    world_size: int
    reason: str
    """The run's verdict as this rank received it (``rank 3 died: ...``)."""
    step: int
    captured_at: float
    """Wall clock (s since the epoch)."""
    entries: tuple[CollectiveEntry, ...]
    point_to_point: tuple[PointToPointRecord, ...]
    stacks: dict[str, tuple[Frame, ...]]
    """Every thread's Python stack, innermost first, by thread name."""
    main_thread: str
    groups: tuple[GroupRecord, ...]
    coordinates: dict[str, dict[str, int]] = field(default_factory=dict)
    """Every rank's mesh coordinates (``{"3": {"pp": 0, "dp_shard": 1, "tp": 1}}``), from the Layout."""
    flight_recorder: bool = True
    """False when the flight recorder was off (``TORCH_FR_BUFFER_SIZE=0``) or could not be read."""
    raised: bool = False
    """This rank's own step raised a communication error (a timeout, a broken connection): it was waiting. Its
    main thread's stack is then the capture's, and the collective it waited in is marked retired by then."""
    error: str = ""
    """This rank's own error when it failed by itself (not a communication error): it is a culprit."""


@dataclass(frozen=True)
class Culprit:
    rank: int
    kind: str
    """never_joined, skipped, mismatch, stuck, dead, never_sent, never_received."""
    dim: str
    """The mesh role of the group (``tp``, ``dp_shard``, ``pp``, ``world``)."""
    group_ranks: tuple[int, ...]
    op: str
    seq: int | None
    frame: str | None
    """Where the rank is (its stack) or where the op is called (its peers' frames), ``file:line in function``."""
    waited_s: float | None
    """How long the ranks that did join had waited when they were captured."""
    detail: str


@dataclass(frozen=True)
class HangReport:
    culprits: tuple[Culprit, ...]
    dead: tuple[int, ...]
    captured: tuple[int, ...]
    missing: tuple[int, ...]
    """Ranks without a capture (dead, or the store and the shared folder both unreachable)."""
    summary: tuple[str, ...]
    """One sentence per culprit in mesh terms, then the consequences."""
    reason: str = ""


def to_dict(value: Any) -> Any:
    """A record (or anything holding records) as plain JSON-able values."""
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: to_dict(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_dict(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_dict(v) for k, v in value.items()}
    return value


def to_json(record: Any, indent: int | None = 1) -> str:
    return json.dumps(to_dict(record), indent=indent)


def _frames(values: list[dict[str, Any]]) -> tuple[Frame, ...]:
    return tuple(Frame(str(v["file"]), int(v["line"]), str(v["name"])) for v in values)


def capture_from_dict(values: dict[str, Any]) -> RankCapture:
    entries = tuple(CollectiveEntry(
        e["group"], int(e["seq"]), e["op"], tuple(tuple(s) for s in e["input_sizes"]), tuple(e["input_dtypes"]),
        bool(e["retired"]), e.get("started_ns"), _frames(e.get("frames", []))) for e in values["entries"])
    p2p = tuple(PointToPointRecord(**p) for p in values["point_to_point"])
    groups = tuple(GroupRecord(g["name"], g["desc"], g["role"], tuple(g["ranks"])) for g in values["groups"])
    stacks = {name: _frames(frames) for name, frames in values["stacks"].items()}
    known = {f.name for f in fields(RankCapture)}
    rest = {k: v for k, v in values.items() if k in known and k not in
            ("entries", "point_to_point", "groups", "stacks")}
    return RankCapture(entries=entries, point_to_point=p2p, groups=groups, stacks=stacks, **rest)


def report_from_dict(values: dict[str, Any]) -> HangReport:
    culprits = tuple(Culprit(**{**c, "group_ranks": tuple(c["group_ranks"])}) for c in values["culprits"])
    return HangReport(culprits, tuple(values["dead"]), tuple(values["captured"]), tuple(values["missing"]),
                      tuple(values["summary"]), values.get("reason", ""))


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and rename: a reader never sees half a record, even if this rank dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def read_captures(folder: Path) -> dict[int, RankCapture]:
    """Every ``rank<R>/capture.json`` under ``folder`` (a diagnostics dir), by rank; unreadable ones are skipped."""
    captures = {}
    for path in sorted(Path(folder).glob(f"rank*/{CAPTURE_FILE}")):
        try:
            capture = capture_from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        captures[capture.rank] = capture
    return captures


__all__ = ["CAPTURE_FILE", "HANG_FILE", "CollectiveEntry", "Culprit", "Frame", "GroupRecord", "HangReport",
           "PointToPointRecord", "RankCapture", "capture_from_dict", "read_captures",
           "report_from_dict", "to_dict", "to_json", "write_atomic"]
