"""Dead-rank detection: heartbeats through the rendezvous store, so that when one rank dies the others
stop within seconds, saying which rank, instead of hanging until the process-group timeout.

Every rank bumps its own counter each ``interval``; rank r watches rank r+1 (so the store sees a few
requests per rank per interval, whatever the world size). A counter that stops for ``dead_after``
while its rank has not finished is a death: the watcher posts a verdict, and every rank that reads
it prints it and exits 1. The clock starts at the peer's first beat: ranks reach their watchdogs seconds apart on a
loaded host, and a peer that dies before its first beat breaks a collective, which `confirm_death` judges. No clocks
are compared between machines. No rank exits before every rank still able to has delivered the verdict to its
listeners (their reports) and acknowledged it, or `linger_bound` after its own delivery: a launcher ends every process
once the first exits (Lightning's at once, torchrun's after 30 s), and rank 0's process usually hosts the store.

With evidence, a verdict comes sooner than ``dead_after``: a rank whose collective broke or timed out reads
every counter for ``confirm_after`` (a counter that does not move in that window belongs to a dead rank); a
rank that raises posts its own failure and the others follow ``confirm_after`` later (each first gets that
long to fail by itself); a store that stops answering for ``confirm_after`` means its host is gone. So a
run stops within the process-group timeout plus a few seconds, whatever ``dead_after`` is.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from collections.abc import Callable

from lightning_nd.runtime.job import store_prefix

MAX_REASON = 2000


def parse_verdict(value: bytes, world_size: int) -> tuple[int, str] | None:
    """``b"<rank>|<reason>"`` as (rank, reason), or None when it is not a verdict of a world of ``world_size``."""
    rank, bar, reason = value[:MAX_REASON].decode(errors="replace").partition("|")
    if not bar or not reason or not rank.isdigit() or len(rank) > 7 or int(rank) >= world_size:
        return None
    return int(rank), reason


def _store_gone(error: Exception) -> tuple[int, str]:
    return 0, f"died or is unreachable: the rendezvous store does not answer ({error})"


CONFIRM_AFTER_S = 5.0
_runs = itertools.count()  # every rank starts its watchdogs in the same order: the same key prefix


def linger_bound(verdict_budget: float, interval: float = 1.0, confirm_after: float = CONFIRM_AFTER_S) -> float:
    """The longest a rank that has delivered the verdict waits for the others' acknowledgements: each reads it within a
    heartbeat or so, gives the culprit ``confirm_after`` to fail by itself, then its listeners ``verdict_budget``."""
    return confirm_after + verdict_budget + 5 * interval


def _pause(seconds: float) -> None:
    """Sleep through what a signal handler raises meanwhile: torchrun's agent sends SIGTERM to every worker once one
    dies, and Lightning's SIGTERM handler broadcasts on the default group, which fails with the dead peer ("Connection
    closed by peer"). That says nothing of the store, so it must not become "rank 0 died or is unreachable"."""
    try:
        time.sleep(seconds)
    except Exception:
        pass


class RankWatchdog:
    def __init__(self, store, rank: int, world_size: int, dead_after: float, interval: float = 1.0,
                 hint: Callable[[], str] = lambda: "", on_verdict: Callable[[int, str], None] | None = None,
                 verdict_budget: float = 10.0, confirm_after: float = CONFIRM_AFTER_S) -> None:
        """``on_verdict(rank, reason)`` is delivered before this watchdog ends the process for a peer's death: on
        a helper thread it waits for, at most ``verdict_budget`` seconds (listeners, loggers' flush)."""
        import torch.distributed as dist

        # Its own connection: a client serialises its requests, and the main thread may block in one (a store
        # barrier, NCCL set-up) for longer than the heartbeat timeout.
        # Keyed by the restart round too: torchrun keeps the store across restarts (`job.py`).
        self.store = dist.PrefixStore(f"{store_prefix('watchdog')}{next(_runs)}/", store.clone())
        self.rank, self.dead_after, self.interval, self.hint = rank, dead_after, interval, hint
        self.world_size, self.confirm_after = world_size, min(confirm_after, dead_after)
        self.on_verdict, self.verdict_budget = on_verdict, verdict_budget
        self.peer = (rank + 1) % world_size
        self._stop, self._handling = threading.Event(), threading.Event()
        self._lock, self._announced = threading.Lock(), False
        self._thread = threading.Thread(target=self._run, name="lightning-nd-watchdog", daemon=True)

    def start(self) -> None:
        self.store.add(f"beat/{self.rank}", 1)
        self._thread.start()

    def halt(self) -> None:
        """This rank failed: stop beating and judging (the others learn of it), whatever this process does next."""
        self._stop.set()
        self._thread.join()

    def stop(self) -> None:
        """This rank finished normally: its silence from now on is no death."""
        self.halt()
        try:
            self.store.set(f"done/{self.rank}", "1")
        except Exception:  # the store is gone with a rank that finished first: nobody is left to watch
            pass

    def handling(self) -> None:
        """This rank's own step failed and its main thread is handling it (the verdict, then the exception goes
        on up): the watchdog no longer ends the process for a peer's failure. A process that carries on after a
        failed run (a sweep's next job) must not be ended by the failed run's watchdog."""
        with self._lock:  # after this, the watchdog's own verdict path (below) no longer exits
            self._handling.set()

    def report_failure(self, reason: str) -> None:
        self._post(self.rank, f"failed: {reason}")

    def verdict(self) -> tuple[int, str] | None:
        """The verdict posted, if any; a value that is not one (another rank than this world's, not ``<rank>|<reason>``:
        a peer's bug or a forgery) is none."""
        if not self.store.check(["verdict"]):
            return None
        return parse_verdict(self.store.get("verdict"), self.world_size)

    def beat(self, rank: int) -> int:
        """``rank``'s heartbeat count (0 before its first beat, or when its key holds no count: read, not added to, as
        the store's server drops the connection of an ``add`` to a key that holds no number)."""
        key = f"beat/{rank}"
        if not self.store.check([key]):
            return 0
        value = self.store.get(key)
        return int(value) if value.isdigit() and len(value) <= 18 else 0

    def heartbeats(self) -> dict[int, int]:
        """Every rank's heartbeat count now."""
        return {rank: self.beat(rank) for rank in range(self.world_size)}

    def confirm_death(self) -> tuple[int, str] | None:
        """After a broken or timed-out collective: the verdict already posted, else a rank whose heartbeat does not
        move for ``confirm_after`` (posted as its death), else None (nobody died: this rank's own failure)."""
        try:
            first, deadline = self.heartbeats(), time.monotonic() + self.confirm_after
            while (found := self.verdict()) is None and time.monotonic() < deadline:
                _pause(self.interval / 2)
            if found is not None:
                return found
            now = self.heartbeats()
            silent = [rank for rank in now if now[rank] == first[rank] and rank != self.rank
                      and not self.store.check([f"done/{rank}"])]
            if silent:
                self._post(silent[0], f"died: no heartbeat for {self.confirm_after:.0f} s after a collective broke"
                                      " (killed, crashed or out of memory)")
                return self.verdict()
        except Exception as error:
            return _store_gone(error)
        return None

    def announce(self, rank: int, reason: str) -> None:
        """Print the verdict once (the watchdog thread and the failing step may both get to it)."""
        with self._lock:
            if not self._announced:
                self._announced = True
                print(f"lightning-nd: rank {rank} {reason}. Rank {self.rank} stops too (exit 1) rather than wait for"
                      f" the process-group timeout.{self.hint()}", file=sys.stderr, flush=True)

    def acknowledge(self) -> None:
        """This rank has the verdict and has delivered it (its listeners, which may use the store, have run)."""
        try:
            self.store.set(f"read/{self.rank}", "1")
        except Exception:  # the store is gone: nobody waits for this rank any more
            pass

    def linger(self) -> None:
        """Before this process exits, wait until every rank that can still read the verdict (all but a dead culprit
        and the ranks that finished) has acknowledged it, at most `linger_bound`: this exit may be what makes the
        launcher end the others, and rank 0's may take the store with it."""
        deadline = time.monotonic() + linger_bound(self.verdict_budget, self.interval, self.confirm_after)
        try:
            found = self.verdict()
            dead = found[0] if found is not None and found[1].startswith("died") else None
            readers = [f"read/{rank}" for rank in range(self.world_size)
                       if rank not in (self.rank, dead) and not self.store.check([f"done/{rank}"])]
            while readers and time.monotonic() < deadline and not self.store.check(readers):
                time.sleep(self.interval / 10)
        except Exception:  # the store is gone: there is nothing left to wait for
            return

    def _post(self, rank: int, reason: str) -> None:
        """The first verdict stands; a value there that is none (`verdict`) is replaced, not left blocking it."""
        held = self.store.get("verdict") if self.store.check(["verdict"]) else b""
        if held and parse_verdict(held, self.world_size) is not None:
            return
        self.store.compare_set("verdict", held, f"{rank}|{reason[:MAX_REASON]}")  # type: ignore[arg-type]  # bytes, as held

    def _run(self) -> None:
        last_count, last_change, unreachable_since, failure_seen, found = -1, time.monotonic(), None, None, None
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                self.store.add(f"beat/{self.rank}", 1)
                count = self.beat(self.peer)
                if count != last_count or count == 0:  # 0: the peer has not started its watchdog yet (see below)
                    last_count, last_change = count, now
                elif now - last_change > self.dead_after and not self.store.check([f"done/{self.peer}"]):
                    self._post(self.peer, f"died: no heartbeat for {now - last_change:.0f} s"
                                          " (killed, crashed or out of memory)")
                found = self.verdict()
                unreachable_since = None
            except Exception as error:  # the store's host (rank 0's process, unless torchrun holds it) is gone
                unreachable_since = unreachable_since or now
                if found is None and now - unreachable_since <= self.confirm_after:
                    continue
                found = found or _store_gone(error)
                failure_seen = failure_seen or now - self.confirm_after  # the store is gone: no one else will report
            if found is None or self._stop.is_set() or self._handling.is_set():
                continue
            rank, reason = found
            if reason.startswith("failed") and rank != self.rank:
                failure_seen = failure_seen or now  # give this rank time to fail (and report) by itself
                if now - failure_seen <= self.confirm_after:
                    continue
            if rank != self.rank:
                self.announce(rank, reason)
                self._deliver(rank, reason)
                self.acknowledge()
                self.linger()
                with self._lock:
                    if self._handling.is_set():  # this rank's own failure came meanwhile: its main thread goes on
                        return
                    os._exit(1)

    def _deliver(self, rank: int, reason: str) -> None:
        """Hand the verdict to ``on_verdict`` and wait for it, at most ``verdict_budget`` seconds."""
        if self.on_verdict is None:
            return
        delivery = threading.Thread(target=self.on_verdict, args=(rank, reason), name="lightning-nd-watchdog-verdict",
                                    daemon=True)
        delivery.start()
        delivery.join(self.verdict_budget)
