"""`FailureMonitor`: two-phase process-group timeouts and the dead-rank watchdog, for `NDParallel`.

Start-up, the first optimizer step (compilation, first allocations) and checkpoint save/load run under
``init_timeout``; after the first step, once every rank has finished it (a barrier under the long timeout,
so a slower rank still in its first step is not judged by the short one), every process group switches
to the short ``timeout``, so a hung collective fails fast. The watchdog (`runtime/watchdog.py`) stops every
rank within ``heartbeat_timeout`` of one rank dying, naming it and the checkpoint to resume from; the
verdict reaches the strategy's event listeners before the process exits (`events.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta

from lightning_nd.runtime.errors import chain_text, exception_chain, first_line, out_of_memory_in
from lightning_nd.runtime.timeouts import set_timeout
from lightning_nd.runtime.watchdog import RankWatchdog, linger_bound
from lightning_nd.strategy.events import VERDICT_BUDGET_S

WATCHDOG = "lightning-nd-watchdog"  # the watchdog thread's name, as a verdict's ``thread``

# What a rank sees when a peer dies under it (gloo, NCCL, the store): wait for the watchdog to name the peer.
COMMUNICATION_ERRORS = ("connection closed", "connection reset", "broken pipe", "timed out", "nccl error",
                        "distnetworkerror", "distbackenderror")


class FailureMonitor:
    def __init__(self, step_timeout: timedelta, init_timeout: timedelta, heartbeat_timeout: timedelta | None,
                 barrier: Callable[[], None], resume_hint: Callable[[], str],
                 on_verdict: Callable[[int, str, str, bool], None]) -> None:
        self.step_timeout, self.init_timeout, self.heartbeat_timeout = step_timeout, init_timeout, heartbeat_timeout
        self._barrier, self._resume_hint, self._deliver = barrier, resume_hint, on_verdict
        self._watchdog: RankWatchdog | None = None
        self._stepped = self._failed = False
        self._verdict_lock, self._delivered, self._delivery_done = threading.Lock(), False, threading.Event()

    def _on_verdict(self, culprit: int, reason: str, thread: str, communication: bool = False) -> None:
        """Deliver the run's verdict once (the main thread and the watchdog may both come to it). The second comer
        waits for the first delivery to end (at most ``VERDICT_BUDGET_S``): a main thread that went on to exit
        would end the process while the watchdog's listeners still write their captures."""
        with self._verdict_lock:
            first = not self._delivered
            self._delivered = True
        if not first:
            self._delivery_done.wait(VERDICT_BUDGET_S)
            return
        try:
            self._deliver(culprit, reason, thread, communication)
        finally:
            self._delivery_done.set()

    def exit_grace(self) -> float | None:
        """How long the other ranks may take to end by themselves once one rank's process has ended: its death seen
        (``heartbeat_timeout`` at most), then the verdict delivered and acknowledged everywhere. None: no watchdog."""
        if self.heartbeat_timeout is None:
            return None
        return self.heartbeat_timeout.total_seconds() + linger_bound(VERDICT_BUDGET_S)

    def start(self) -> None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        self._stepped = self._failed = self._delivered = False
        self._delivery_done.clear()
        set_timeout(self.init_timeout)  # a later fit in this process starts in the long phase again
        if self.heartbeat_timeout is None or dist.get_world_size() == 1:
            return
        self._watchdog = RankWatchdog(_get_default_store(), dist.get_rank(), dist.get_world_size(),
                                      self.heartbeat_timeout.total_seconds(), hint=self._resume_hint,
                                      verdict_budget=VERDICT_BUDGET_S,
                                      on_verdict=lambda culprit, reason: self._on_verdict(culprit, reason, WATCHDOG))
        self._watchdog.start()

    @contextmanager
    def long_timeout(self) -> Generator[None, None, None]:
        set_timeout(self.init_timeout)
        try:
            yield
        finally:
            set_timeout(self.step_timeout if self._stepped else self.init_timeout)

    def after_optimizer_step(self) -> None:
        if not self._stepped:
            self._barrier()  # every rank is past its first step before any judges the others by the short timeout
            self._stepped = True
            set_timeout(self.step_timeout)

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        watchdog = self._watchdog
        summary, text = _describe(exception)
        communication = any(words in text.lower() for words in COMMUNICATION_ERRORS)
        thread = threading.current_thread().name
        if watchdog is None:
            self._on_verdict(_own_rank(), f"failed: {summary}", thread, communication)
            return
        watchdog.handling()
        # Perhaps a peer's death seen first as a broken connection or a timeout: the heartbeats tell.
        found = watchdog.confirm_death() if communication else None
        if found is not None and found[0] != watchdog.rank:
            watchdog.announce(*found)
            self._on_verdict(found[0], found[1], thread, communication)
        else:
            watchdog.report_failure(summary)
            self._on_verdict(watchdog.rank, f"failed: {summary}", thread, communication)
        watchdog.acknowledge()
        watchdog.halt()  # this rank is done with this run, even if the process carries on (a retry)
        watchdog.linger()

    def teardown(self) -> None:
        if self._watchdog is not None:
            if not self._failed:
                self._barrier()  # watched while waiting: no rank leaves (perhaps with the store) before all are here
                self._watchdog.stop()
            self._watchdog = None


def _describe(exception: BaseException) -> tuple[str, str]:
    """One line for the verdict, and the text of the whole chain: a wrapper (the pipeline schedule re-raises a
    peer's broken connection as a bare ``RuntimeError``, a stage's out-of-memory error as "[Stage 0] failed to run
    forward") must not hide its cause, so an out-of-memory cause is named in the line too (peers relay it)."""
    chain = exception_chain(exception)
    speaking = next((link for link in chain if str(link).strip()), exception)  # the first link with a message
    summary = first_line(speaking)
    cause = out_of_memory_in(exception)
    if cause is not None and cause is not speaking:
        summary = f"{summary[:200]} (from {first_line(cause)})"
    return summary[:600], chain_text(exception)


def _own_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
