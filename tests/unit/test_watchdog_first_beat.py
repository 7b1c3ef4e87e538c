"""`RankWatchdog`: a peer's silence is timed from its first beat, so a rank that reaches its watchdog later than its
watcher (seconds apart on a loaded host: the suite's fault tests saw "rank 2 died: no heartbeat for 4 s" before any
rank had died) is not declared dead; once it has beaten, ``dead_after`` of silence is a death. Two ranks' watchdogs
on one real TCPStore in one process, each set `handling` so that a verdict does not end the test's process."""

from __future__ import annotations

import itertools
import time
from datetime import timedelta

import torch.distributed as dist

from lightning_nd.runtime import watchdog
from lightning_nd.runtime.watchdog import RankWatchdog

DEAD_AFTER = 0.5


def _dog(monkeypatch, store: dist.TCPStore, rank: int) -> RankWatchdog:
    monkeypatch.setattr(watchdog, "_runs", itertools.count())  # one key prefix, as separate ranks would have
    dog = RankWatchdog(store, rank, 2, dead_after=DEAD_AFTER, interval=0.05, confirm_after=DEAD_AFTER)
    dog.handling()
    return dog


def test_a_peer_is_timed_from_its_first_beat_then_its_silence_is_a_death(monkeypatch):
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    watcher = _dog(monkeypatch, store, 0)
    watcher.start()
    try:
        time.sleep(4 * DEAD_AFTER)  # rank 1 has not started its watchdog yet
        assert watcher.verdict() is None
        late = _dog(monkeypatch, store, 1)
        late.start()
        time.sleep(2 * DEAD_AFTER)
        assert watcher.verdict() is None  # beating: alive
        late.halt()  # silent from now on, and not finished
        deadline = time.monotonic() + 10 * DEAD_AFTER
        while watcher.verdict() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        found = watcher.verdict()
        assert found is not None and found[0] == 1 and found[1].startswith("died: no heartbeat"), found
    finally:
        watcher.halt()
