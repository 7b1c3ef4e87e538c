"""How much of a file from elsewhere the diagnostics read, and how: every file a run leaves (captures, dumps, logs,
traces, a sweep's records) may come from another cluster, be cut short or be crafted.

A file is read only if it is a regular file of at most `MAX_FILE_BYTES` (a gzip's content too); JSON only as JSON
(no ``NaN`` or ``Infinity``), nested at most as deep as Python's parser allows; a rank or a world size is at most
`MAX_RANKS`. What breaks a rule is a `ValueError` naming the file, which each reader turns into a skip or one line.
"""

from __future__ import annotations

import gzip
import json
import os
import stat
from pathlib import Path
from typing import Any

MAX_FILE_BYTES = 256 << 20
MAX_RANKS = 1 << 17
"""More ranks than any job runs: a world, a rank or a group member beyond it is not read as one."""


def read_bytes(path: Path, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (a ``.gz`` one's content, at most as much)."""
    found = os.stat(path)
    if not stat.S_ISREG(found.st_mode):
        raise ValueError(f"{path} is not a regular file")
    if found.st_size > limit:
        raise ValueError(f"{path} has {found.st_size} bytes, more than the {limit} read")
    if path.suffix != ".gz":
        return path.read_bytes()
    with gzip.open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} holds more than {limit} bytes once decompressed")
    return data


def read_text(path: Path, limit: int = MAX_FILE_BYTES) -> str:
    return read_bytes(path, limit).decode(errors="replace")


def _no_constant(name: str) -> Any:
    raise ValueError(f"`{name}` is not a JSON number")


def loads(text: str | bytes, where: object = "the JSON") -> Any:
    """JSON as JSON: ``NaN`` and ``Infinity`` refused, nesting too deep for the parser a `ValueError`."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(f"{where} is nested too deep") from None


def read_json(path: Path, limit: int = MAX_FILE_BYTES) -> Any:
    return loads(read_bytes(path, limit), path)


def rank(value: object, what: str = "a rank") -> int:
    """``value`` as a rank (``0 <= rank < MAX_RANKS``), from an int or a string of digits."""
    if isinstance(value, str) and value.strip().isdigit() and len(value.strip()) <= 7:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_RANKS:
        raise ValueError(f"{what} of {str(value)[:40]!r} is not a rank (0 to {MAX_RANKS - 1})")
    return value
