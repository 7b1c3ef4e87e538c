"""The files the monitors leave under ``<log_dir>/diagnostics/``, their names, and how they are written and read."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from diagnostics.records.bottleneck import WindowRecord
from diagnostics.records.bounds import loads, rank, read_json
from diagnostics.records.codec import Record, from_dict
from diagnostics.records.collectives import RankCapture
from diagnostics.records.routing import RoutingInterval

CAPTURE_FILE = "capture.json"
"""Each live rank's `RankCapture` when the run failed, in ``rank<R>/``."""
HANG_FILE = "hang.json"
"""The `HangReport`, from the lowest captured rank."""
BOTTLENECK_FILE = "bottleneck.jsonl"
"""One `WindowRecord` a line, from rank 0."""
MEMORY_FILE = "memory-rank{rank}.json"
"""Each rank's `MemoryReport` when a rank ran out of memory."""
ROUTING_FILE = "routing.jsonl"
"""One `RoutingInterval` a line, from rank 0."""

log = logging.getLogger("diagnostics")


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and rename: a reader never sees half a record, even if this rank dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def read_captures(folder: Path) -> dict[int, RankCapture]:
    """Every ``rank<R>/capture.json`` under ``folder`` (a diagnostics dir), by rank; an unreadable one is skipped with
    a warning naming it: not a bounded JSON record (`bounds`), or one whose rank, world size and groups are not those
    of a world."""
    captures = {}
    for path in sorted(Path(folder).glob(f"rank*/{CAPTURE_FILE}")):
        try:
            capture = from_dict(RankCapture, read_json(path))
            world = capture.world_size
            rank(world - 1, "a world size")
            if rank(capture.rank) >= world or any(rank(member) >= world for g in capture.groups for member in g.ranks):
                raise ValueError(f"its rank or a group member is not below its world size {world}")
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("skipped `%s`, which is not a rank's capture (%s: %s)", path, type(error).__name__,
                        str(error)[:200])
            continue
        captures[capture.rank] = capture
    return captures


def read_lines(cls: type[Record], text: str) -> list[Record]:
    """Every line of a ``.jsonl`` file of ``cls`` records; a line cut short by a dying process is skipped."""
    records = []
    for line in text.splitlines():
        try:
            records.append(from_dict(cls, loads(line)))
        except (ValueError, KeyError, TypeError):
            continue
    return records


def read_windows(text: str) -> list[WindowRecord]:
    """Every line of a ``bottleneck.jsonl``."""
    return read_lines(WindowRecord, text)


def read_intervals(text: str) -> list[RoutingInterval]:
    """Every line of a ``routing.jsonl``."""
    return read_lines(RoutingInterval, text)
