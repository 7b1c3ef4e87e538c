"""What a peer leaves in the store is read as a stranger's: a verdict naming a rank outside the world, or not of the
form ``<rank>|<reason>``, is no verdict and does not block the real one; a heartbeat that holds no count reads as no
beat, not as a store gone (which would name rank 0 dead). One real TCPStore in one process."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_nd.runtime import watchdog
from lightning_nd.runtime.watchdog import RankWatchdog, parse_verdict


@pytest.fixture
def dog(monkeypatch):
    monkeypatch.setattr(watchdog, "_runs", itertools.count())
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    found = RankWatchdog(store, 0, 2, dead_after=5.0, interval=0.05, confirm_after=0.2)
    found.handling()
    yield found
    del store  # the server lives as long as the test


@pytest.mark.parametrize("forged", [b"7|died: forged", b"-1|died", b"x|died", b"1", b"1|", b"9" * 5000 + b"|died",
                                    b"\xff\xfe|died"])
def test_a_forged_verdict_is_none_and_the_real_one_replaces_it(dog, forged):
    dog.store.set("verdict", forged)
    assert dog.verdict() is None and parse_verdict(forged, 2) is None
    dog.report_failure("RuntimeError: boom")
    assert dog.verdict() == (0, "failed: RuntimeError: boom")


def test_a_beat_that_holds_no_count_is_no_beat_and_no_dead_store(dog):
    dog.store.set("beat/1", "not a number")
    dog.store.add("beat/0", 3)
    assert dog.heartbeats() == {0: 3, 1: 0}
    dog.store.set("done/1", "1")  # and it finished: its silence is no death
    assert dog.confirm_death() is None
