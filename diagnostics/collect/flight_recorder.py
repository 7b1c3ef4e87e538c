"""The flight recorder's ring of collectives (torch's ``_dump_fr_trace``), read as `CollectiveEntry` records and
written back as a dump that torch's own analyzer (``python -m torch.distributed.flight_recorder.fr_trace``) reads.

On gloo torch 2.13 leaves ``pg_config`` as ``{'': {'name': '', 'ranks': '[]'}}``; the analyzer then fails with
``KeyError``. The dump is written with the real groups (name, desc, ranks) from the strategy's records.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from diagnostics.records import CollectiveEntry, Frame, GroupRecord, RankCapture
from diagnostics.records.bounds import MAX_RANKS, loads, read_bytes
from diagnostics.records.bounds import rank as a_rank

DUMP_PREFIX = "fr_rank_"
"""Dump files are ``fr/fr_rank_<R>``: the analyzer infers the prefix from such a folder."""
MAX_ENTRIES, MAX_FRAMES, MAX_TENSORS = 4096, 64, 64
"""What is read of a dump: its last entries (the newest; torch keeps 2000 by default), each entry's first frames and
tensors. A pickle can name one object many times at no cost in the file: its size says nothing of what it holds."""
MAX_ALL_FRAMES = 1 << 18


def read_dump() -> dict[str, Any] | None:
    """This process's flight-recorder dump (collectives and stacks, retired ones too); None when it is off."""
    import torch

    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None:
        return None
    try:
        return pickle.loads(dump(True, True, False))
    except Exception:  # off (buffer size 0) or a build without it: the capture says so
        return None


class _PlainData(pickle.Unpickler):
    """A dump holds dicts, lists, tuples, strings, numbers, booleans and None, none of which a pickle names: a file
    that names any class or function is not a dump, and what it names is never looked up (nor run)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names `{module}.{name}`, which a flight-recorder dump never holds")


def load_dump(path: Path) -> dict[str, Any]:
    """A dump file (torch's pickle, or its JSON form) as plain data; ValueError naming the file when it is not one."""
    data = read_bytes(path)
    try:  # a pickle never starts with `{`
        dump = loads(data, path) if data.lstrip()[:1] == b"{" else _PlainData(io.BytesIO(data)).load()
    except Exception as error:  # noqa: BLE001 (garbage, a truncated or crafted file: each fails its own way)
        raise ValueError(f"{path} is not a flight-recorder dump ({type(error).__name__}: {error})") from None
    if isinstance(dump, dict):
        return dump
    raise ValueError(f"{path} is not a flight-recorder dump (it holds a {type(dump).__name__}, not a dict)")


def entries_of(dump: dict[str, Any]) -> tuple[CollectiveEntry, ...]:
    entries, frames_left = [], MAX_ALL_FRAMES
    for entry in list(dump.get("entries", ()))[-MAX_ENTRIES:]:
        if entry.get("is_p2p"):
            continue
        group = entry.get("process_group") or ("", "")
        name = str(entry.get("profiling_name") or "")[:200]
        frames = tuple(Frame(str(f.get("filename", "?"))[:500], _count(f.get("line", 0)), str(f.get("name", "?"))[:200])
                       for f in list(entry.get("frames", ()))[:min(MAX_FRAMES, frames_left)])
        frames_left -= len(frames)
        entries.append(CollectiveEntry(
            group=str(group[0])[:200], seq=_count(entry.get("collective_seq_id", -1)), op=name.split(":", 1)[-1],
            input_sizes=tuple(tuple(_count(d) for d in list(size)[:MAX_TENSORS])
                              for size in list(entry.get("input_sizes", ()))[:MAX_TENSORS]),
            input_dtypes=tuple(str(d)[:40] for d in list(entry.get("input_dtypes", ()))[:MAX_TENSORS]),
            retired=bool(entry.get("retired")) or entry.get("state") == "completed",
            started_ns=entry.get("time_created_ns") if isinstance(entry.get("time_created_ns"), int) else None,
            frames=frames))
    return tuple(entries)


def _count(value: object) -> int:
    """A sequence number, a size or a line: an int that fits 64 bits (``int()`` of a 5000-digit string is refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value < 1 << 63:
        raise ValueError(f"{str(value)[:40]!r} is not a count")
    return value


def with_groups(dump: dict[str, Any], groups: Iterable[GroupRecord], rank: int) -> dict[str, Any]:
    """The dump with ``pg_config`` naming every group's desc and ranks (what torch's analyzer keys on).

    Groups made by splitting (a mesh dim's groups) share one name across their member sets (both tp groups of a
    2 x 2 mesh are ``'15'``); the analyzer keys groups by name alone, so here each is named ``<name>:<ranks>``."""
    ranks_of = {g.name: g.ranks for g in groups}

    def unique(name: str) -> str:
        return f"{name}:{','.join(map(str, ranks_of.get(name, (rank,))))}"

    config = {unique(g.name): {"name": unique(g.name), "desc": g.desc, "ranks": str(list(g.ranks))} for g in groups}
    entries = []
    for entry in dump.get("entries", ()):
        name, desc = (entry.get("process_group") or ("", ""))[:2]
        config.setdefault(unique(str(name)), {"name": unique(str(name)), "desc": str(desc), "ranks": str([rank])})
        entries.append({**entry, "process_group": (unique(str(name)), desc)})
    return {**dump, "entries": entries, "pg_config": config, "pg_status": {}, "rank": rank}


def capture_of_dump(dump: dict[str, Any], rank: int, world_size: int, captured_at: float,
                    coordinates: dict[str, dict[str, int]] | None = None) -> RankCapture:
    """A capture from a flight-recorder dump alone (torch's own, from an NCCL run): entries and groups, no stacks;
    the world size is at least what its groups' ranks say, ``coordinates`` come from the run's ``layout.json``."""
    groups = []
    for name, config in (dump.get("pg_config") or {}).items():
        listed = str(config.get("ranks", "[]"))[:8 * MAX_RANKS].strip("[]").split(",")
        ranks = tuple(a_rank(r, f"group {str(name)[:40]}'s member") for r in listed if r.strip())
        desc = str(config.get("desc", ""))
        role = "world" if desc == "default_pg" else desc.removeprefix("mesh_") or str(name)
        groups.append(GroupRecord(str(name), desc, role, ranks or (rank,)))
    world = max([world_size, rank + 1, *(max(g.ranks) + 1 for g in groups)])
    return RankCapture(rank, world, "flight-recorder dump", 0, captured_at, entries_of(dump), (), {}, "",
                       tuple(groups), coordinates or {})


def write_dump(dump: dict[str, Any], folder: Path, rank: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{DUMP_PREFIX}{rank}"
    temporary = folder / f".{DUMP_PREFIX}{rank}.{os.getpid()}.tmp"
    temporary.write_bytes(pickle.dumps(dump))
    os.replace(temporary, path)
    return path
