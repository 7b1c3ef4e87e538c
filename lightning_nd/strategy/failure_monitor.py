"""Mixin for `NDParallel`: two-phase process-group timeouts and the dead-rank watchdog.

Start-up, the first optimizer step (compilation, first allocations) and checkpoint save/load run under
``init_timeout``; after the first step every process group switches to the short ``timeout``, so a
hung collective fails fast. The watchdog (`watchdog.py`) stops every rank within ``heartbeat_timeout``
of one rank dying, naming it and the checkpoint to resume from.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from lightning_nd.runtime.watchdog import RankWatchdog

# What a rank sees when a peer dies under it (gloo, NCCL, the store): wait for the watchdog to name the peer.
COMMUNICATION_ERRORS = ("connection closed", "connection reset", "broken pipe", "timed out", "nccl error",
                        "distnetworkerror", "distbackenderror")


def check_timeouts(timeout: Any, init_timeout: Any, heartbeat_timeout: Any) -> tuple[timedelta, timedelta, timedelta | None]:
    """The three as ``timedelta`` (numbers are seconds, as a Hydra config gives them); refused when not positive."""
    checked = []
    for name, value in (("timeout", timeout), ("init_timeout", init_timeout), ("heartbeat_timeout", heartbeat_timeout)):
        if value is None and name == "heartbeat_timeout":
            checked.append(None)
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = timedelta(seconds=value)
        if not isinstance(value, timedelta) or value.total_seconds() < (2 if name == "heartbeat_timeout" else 1):
            raise ValueError(f"`NDParallel({name}={value!r})` must be a `datetime.timedelta` or seconds, at least"
                             f" {2 if name == 'heartbeat_timeout' else 1} s. HINT: e.g. `{name}=timedelta(minutes=5)`"
                             f"{' or None to turn the watchdog off' if name == 'heartbeat_timeout' else ''}.")
        checked.append(value)
    return checked[0], checked[1], checked[2]


def set_timeout(timeout: timedelta) -> None:
    """Every process group of this process (the world and the mesh's) waits at most ``timeout``."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    for group in list(_world.pg_map):
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            _set_pg_timeout(timeout, group)


class FailureHandling:
    _watchdog: RankWatchdog | None = None
    _stepped = False
    _failed = False

    def _start_failure_handling(self) -> None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        self._stepped = self._failed = False
        set_timeout(self._init_timeout)  # a later fit in this process starts in the long phase again
        if self._heartbeat_timeout is None or dist.get_world_size() == 1:
            return
        self._watchdog = RankWatchdog(_get_default_store(), dist.get_rank(), dist.get_world_size(),
                                      self._heartbeat_timeout.total_seconds(), hint=self._resume_hint)
        self._watchdog.start()

    def _resume_hint(self) -> str:
        last = getattr(self, "last_checkpoint", None)
        return f" HINT: resume with `Trainer.fit(..., ckpt_path={str(last)!r})`." if last else ""

    @contextmanager
    def _long_timeout(self) -> Generator[None, None, None]:
        set_timeout(self._init_timeout)
        try:
            yield
        finally:
            set_timeout(self._step_timeout if self._stepped else self._init_timeout)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        result = super().optimizer_step(*args, **kwargs)
        if not self._stepped:
            self._stepped = True
            set_timeout(self._step_timeout)
        return result

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        watchdog = self._watchdog
        if watchdog is not None:
            text = f"{type(exception).__name__}: {exception}"
            found = None
            if any(words in text.lower() for words in COMMUNICATION_ERRORS):
                # Probably a peer's death seen first as a broken connection: let its watcher name it.
                found = watchdog.wait_for_verdict(watchdog.dead_after + 3 * watchdog.interval)
            if found is not None and found[0] != watchdog.rank:
                watchdog.announce(*found)
            else:
                watchdog.report_failure(text.splitlines()[0][:300])
            watchdog.halt()  # this rank is done with this run, even if the process carries on (a retry)
            watchdog.linger()
        super().on_exception(exception)

    def teardown(self) -> None:
        if self._watchdog is not None:
            if not self._failed:
                self.barrier()  # watched while waiting: no rank leaves (perhaps with the store) before all are here
                self._watchdog.stop()
            self._watchdog = None
        super().teardown()
