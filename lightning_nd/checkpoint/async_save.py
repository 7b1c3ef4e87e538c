"""Saves that return once the state is staged: DCP's ``async_save`` copies this rank's shards into CPU memory (on a
GPU this device-to-host copy is the time the training loop waits) and writes them in DCP's background thread; our
commit thread then does what a synchronous save does after writing (`sharded.finish_save`: every rank's files
gathered, the manifest, the folder renamed into place).

Why a gloo group of the checkpoint's own: DCP's write and the commit issue collectives (the save plans, the files each
rank wrote, rank 0's verdict) from background threads while the training loop issues its own on the world and the
mesh's groups. Two threads issuing collectives on one group can enqueue them in different orders on different ranks
(a mismatch or a hang), so they run on a group that only the one save in flight uses, one thread at a time (DCP's,
then ours). gloo, because ``async_save`` needs a CPU-capable group also when the default one is NCCL.

At most one save is in flight: the next one first waits for it to commit. Removing an older checkpoint while a save is
in flight waits for that commit in the background (`SaveInFlight.after_commit`): the older one leaves only once the
newer one is whole, and not at all if the newer one fails, so a crash never leaves no complete checkpoint.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_nd.checkpoint.files import CheckpointError
from lightning_nd.checkpoint.sharded import begin_save, finish_save
from lightning_nd.checkpoint.state_files import write_rng
from lightning_nd.checkpoint.strided import contiguous, restore

log = logging.getLogger("lightning_nd")
COMMIT_THREAD = "lightning-nd-checkpoint-commit"


class SaveInFlight:
    """One asynchronous save: written by DCP's thread, committed by ours. ``committed`` holds the
    ``time.perf_counter()`` at which the checkpoint was whole, or why it never will be."""

    def __init__(self, path: Path, staging: Path, step: int | None, started: float) -> None:
        self.path, self.staging, self.step, self.started = path, staging, step, started
        self.committed: Future[float] = Future()
        self._lock = threading.Lock()
        self._waiting: list[Callable[[], None]] | None = []  # None once the save has ended
        self._landed = False

    def after_commit(self, action: Callable[[], None]) -> None:
        """Run ``action`` once this save has committed: now if it has, in the commit thread when it does, never if it
        fails."""
        with self._lock:
            if self._waiting is not None:
                self._waiting.append(action)
                return
            landed = self._landed
        if landed:
            action()

    def _write_and_commit(self, written: Future[Any], info: dict[str, Any], group: dist.ProcessGroup) -> None:
        try:
            written.result()  # DCP's write, on every rank (its collectives ran on ``group`` too)
            finish_save(self.path, self.staging, info, group)
        except BaseException as error:  # noqa: BLE001 - any failure is the save's, raised on the main thread by `wait`
            with self._lock:
                self._waiting = None
            self.committed.set_exception(error)
            return
        landed = time.perf_counter()
        with self._lock:
            waiting, self._waiting, self._landed = self._waiting or [], None, True
        for action in waiting:
            try:
                action()
            except Exception:  # removing an older checkpoint failed: the new one is whole all the same
                log.exception("lightning-nd: after committing `%s`", self.path)
        self.committed.set_result(landed)


class AsyncSaver:
    """Every rank's side of the asynchronous saves: at most one in flight, on a gloo group made at the first save."""

    def __init__(self, timeout: timedelta) -> None:
        """``timeout``: how long the background collectives may wait for the slowest rank's write."""
        self.timeout = timeout
        self.in_flight: SaveInFlight | None = None
        self._group: dist.ProcessGroup | None = None

    def save(self, path: Path, state: dict[str, Any], meta: dict[str, Any], rng: dict[str, Any], info: dict[str, Any],
             step: int | None) -> SaveInFlight:
        """Every rank: wait for the save in flight to commit, stage ``state`` and return; the write and the commit go
        on in the background. Writes what `sharded.save_sharded` writes."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        started = time.perf_counter()
        if self._group is None:  # every rank reaches its first save at the same point: a collective call is safe
            self._group = dist.new_group(backend="gloo", timeout=self.timeout, group_desc="lightning_nd_checkpoint")
        staging = begin_save(path, meta)
        swaps = contiguous(state)
        try:
            # FileSystemWriter stages (copies to CPU) before this returns; THREAD: the write runs in this process.
            written = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(staging, sync_files=True),
                                     process_group=self._group)
        finally:
            restore(swaps, loaded=False)
        assert isinstance(written, Future), "a blocking stager (FileSystemWriter) gives one future, not two"
        write_rng(staging, dist.get_rank(), rng)
        self.in_flight = save = SaveInFlight(path, staging, step, started)
        threading.Thread(target=save._write_and_commit, args=(written, info, self._group), name=COMMIT_THREAD,
                         daemon=True).start()
        return save

    def keep_timeout(self) -> None:
        """Set the checkpoint group's timeout back to ``timeout``, after something set every group's."""
        from torch.distributed.distributed_c10d import _set_pg_timeout

        if self._group is not None:
            _set_pg_timeout(self.timeout, self._group)

    def poll(self) -> SaveInFlight | None:
        """The save in flight if it has committed (it is then no longer in flight); None otherwise. A failed save
        stays in flight for `wait` to raise."""
        save = self.in_flight
        if save is None or not save.committed.done() or save.committed.exception() is not None:
            return None
        self.in_flight = None
        return save

    def wait(self, timeout: float | None = None) -> SaveInFlight | None:
        """Wait for the save in flight to commit and return it (None when there was none). Raises `CheckpointError`
        when it failed, ``TimeoutError`` after ``timeout`` seconds (it is then given up: the process may end before
        it commits, leaving the previous checkpoint the newest complete one)."""
        save, self.in_flight = self.in_flight, None
        if save is None:
            return None
        try:
            save.committed.result(timeout)
        except TimeoutError:
            raise
        except BaseException as error:
            raise CheckpointError(f"Saving `{save.path}` in the background failed: {type(error).__name__}: {error}."
                                  " The checkpoint before it is the newest complete one.") from error
        return save
