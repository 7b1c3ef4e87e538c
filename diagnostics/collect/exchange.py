"""Bringing every rank's capture to every rank after a failure: through the rendezvous store (works across nodes)
and through the shared diagnostics folder (works when the store's host died, on one node or a shared file system).
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from diagnostics.records import (
    CAPTURE_FILE,
    RankCapture,
    from_dict,
    read_captures,
    to_dict,
    to_json,
    write_atomic,
)
from diagnostics.records.bounds import MAX_FILE_BYTES, loads


def unpacked(payload: bytes) -> RankCapture | None:
    """A peer's capture from the store, or None: decompressed to at most `MAX_FILE_BYTES` (a zlib stream can grow a
    thousand times), read as a bounded JSON record."""
    try:
        inflate = zlib.decompressobj()
        data = inflate.decompress(payload, MAX_FILE_BYTES)
        if inflate.unconsumed_tail:
            return None
        return from_dict(RankCapture, loads(data, "a peer's capture"))
    except (zlib.error, ValueError, KeyError, TypeError):
        return None


class CaptureExchange:
    def __init__(self, store, prefix: str, folder: Path, rank: int, world_size: int) -> None:
        """``store``: a client of the rendezvous store of its own (None when there is none)."""
        self.store, self.prefix, self.folder = store, prefix, folder
        self.rank, self.world_size = rank, world_size
        self.store_gone = store is None

    def _store(self, call: Callable):
        if self.store_gone:
            return None
        try:
            return call(self.store)
        except Exception:  # the store's host is gone: from now on, files only
            self.store_gone = True
            return None

    def publish(self, capture: RankCapture) -> Path:
        path = self.folder / f"rank{self.rank}" / CAPTURE_FILE
        write_atomic(path, to_json(capture, indent=None))
        payload = zlib.compress(json.dumps(to_dict(capture)).encode())
        self._store(lambda store: store.set(f"{self.prefix}capture/{self.rank}", payload))
        return path

    def gather(self, skip: set[int], seconds: float) -> dict[int, RankCapture]:
        """Every rank's capture that arrives within ``seconds``; ``skip``: ranks known dead (not waited for)."""
        deadline = time.monotonic() + seconds
        found: dict[int, RankCapture] = {}
        while True:
            for rank in range(self.world_size):
                if rank in found:
                    continue
                key = f"{self.prefix}capture/{rank}"
                if self._store(lambda store: store.check([key])):
                    payload = self._store(lambda store: store.get(key))
                    capture = unpacked(payload) if payload is not None else None
                    if capture is not None and capture.rank == rank:
                        found[rank] = capture
            for rank, capture in read_captures(self.folder).items():
                found.setdefault(rank, capture)
            waiting = [r for r in range(self.world_size) if r not in found and r not in skip]
            if not waiting or time.monotonic() >= deadline:
                return found
            time.sleep(0.2)

    def read(self, key: str) -> str | None:
        """A value the ranks put in the store under this fit's prefix (None when absent or the store is gone)."""
        name = f"{self.prefix}{key}"
        value = self._store(lambda store: store.get(name) if store.check([name]) else None)
        return value[:4096].decode(errors="replace") if isinstance(value, bytes) else None

    def put(self, key: str, value: str) -> None:
        self._store(lambda store: store.set(f"{self.prefix}{key}", value))

    def done(self) -> None:
        """This rank has read what it needs from the store."""
        self._store(lambda store: store.set(f"{self.prefix}done/{self.rank}", "1"))

    def wait_until_read(self, ranks: list[int], seconds: float) -> None:
        """The store's host stays until the others have read their captures (or ``seconds`` pass)."""
        deadline = time.monotonic() + seconds
        keys = [f"{self.prefix}done/{rank}" for rank in ranks if rank != self.rank]
        while keys and time.monotonic() < deadline:
            if self._store(lambda store: store.check(keys)) in (True, None):
                return
            time.sleep(0.2)
