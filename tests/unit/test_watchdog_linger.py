"""`RankWatchdog.linger`: no rank's process ends before every rank that can still read the verdict has acknowledged it
(a launcher ends every process once the first one exits), at most `linger_bound`; a dead culprit and the ranks that
finished are not waited for. Three ranks' watchdogs on one real TCPStore, in one process (no thread of theirs runs)."""

from __future__ import annotations

import itertools
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_nd.runtime import watchdog
from lightning_nd.runtime.watchdog import RankWatchdog

WORLD = 3
PATIENT = 60.0  # a verdict budget long enough that only acknowledgements can end the wait in these tests


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)


def _watchdogs(monkeypatch, store: dist.TCPStore, verdict_budget: float = PATIENT,
               confirm_after: float = 1.0) -> list[RankWatchdog]:
    dogs = []
    for rank in range(WORLD):
        monkeypatch.setattr(watchdog, "_runs", itertools.count())  # one key prefix, as separate ranks would have
        dogs.append(RankWatchdog(store, rank, WORLD, dead_after=60, interval=0.05, verdict_budget=verdict_budget,
                                 confirm_after=confirm_after))
    return dogs


def _lingering(dog: RankWatchdog) -> threading.Thread:
    waiting = threading.Thread(target=dog.linger, daemon=True)
    waiting.start()
    return waiting


def test_the_culprit_stays_until_every_peer_acknowledged(monkeypatch, store):
    dogs = _watchdogs(monkeypatch, store)
    culprit = dogs[1]
    culprit.report_failure("RuntimeError: DefaultCPUAllocator: can't allocate memory")
    culprit.acknowledge()
    waiting = _lingering(culprit)
    dogs[0].acknowledge()
    waiting.join(0.5)
    assert waiting.is_alive(), "the culprit left while rank 2 had not acknowledged the verdict"
    dogs[2].acknowledge()
    waiting.join(30)
    assert not waiting.is_alive()


def test_rank_zero_stays_for_the_culprit_too(monkeypatch, store):
    """Rank 0 waits for the culprit's own acknowledgement (its report written) like any peer's, however long the
    culprit's listeners take within the bound (before: at most 5 heartbeats)."""
    dogs = _watchdogs(monkeypatch, store)
    dogs[2].report_failure("boom")
    dogs[1].acknowledge()
    waiting = _lingering(dogs[0])
    waiting.join(0.5)
    assert waiting.is_alive(), "rank 0 left before the culprit (rank 2) had delivered its own verdict"
    dogs[2].acknowledge()
    waiting.join(30)
    assert not waiting.is_alive()


def test_a_dead_culprit_and_finished_ranks_are_not_waited_for(monkeypatch, store):
    dogs = _watchdogs(monkeypatch, store)
    dogs[0]._post(1, "died: no heartbeat for 60 s (killed, crashed or out of memory)")
    dogs[2].store.set("done/2", "1")  # as `stop()` leaves it: rank 2 finished its run normally
    waiting = _lingering(dogs[0])
    waiting.join(30)
    assert not waiting.is_alive(), "rank 0 waited for a dead rank or a finished one"


def test_a_peer_that_never_acknowledges_is_waited_for_at_most_the_bound(monkeypatch, store):
    dogs = _watchdogs(monkeypatch, store, verdict_budget=0.5, confirm_after=0.1)
    dogs[1].report_failure("boom")
    waiting = _lingering(dogs[1])
    waiting.join(30)
    assert not waiting.is_alive()
    assert watchdog.linger_bound(0.5, 0.05, 0.1) < 30
