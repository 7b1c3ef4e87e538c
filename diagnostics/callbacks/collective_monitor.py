"""`CollectiveMonitor`: collective capture and hang triage for `NDParallel` runs.

Before the process group starts it sets each rank's NCCL log file, the flight recorder and (optionally)
``TORCH_DISTRIBUTED_DEBUG``. When the run fails (a rank times out, raises, or the watchdog names a dead rank),
every live rank writes its flight-recorder dump, every thread's stack and its point-to-point ledger, the ranks
exchange them (store, else the shared folder), and each prints the verdict of `diagnostics.analysis.hang`;
the lowest captured rank writes ``hang.json``, rank 0 the TensorBoard card. Files: ``<dir>/diagnostics/``. While
the run is healthy, every ``log_every_n_steps`` it logs how long each rank waited in the strategy's own
collectives (``collectives/strategy_wait_s`` mean / min / max across ranks, a chart of the `TroubleshootingView`).
"""

from __future__ import annotations

import faulthandler
import itertools
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import Callback, LightningModule, Trainer

from diagnostics.analysis.hang import hang_report
from diagnostics.callbacks.troubleshooting_view import TroubleshootingView
from diagnostics.collect.environment import apply_environment, wanted_environment
from diagnostics.collect.exchange import CaptureExchange
from diagnostics.collect.flight_recorder import DUMP_PREFIX, entries_of, read_dump, with_groups, write_dump
from diagnostics.collect.gather import gather_floats
from diagnostics.collect.ledger import PointToPointLedger
from diagnostics.collect.stacks import stacks_text, thread_stacks
from diagnostics.records import CAPTURE_FILE, HANG_FILE, GroupRecord, RankCapture, to_json, write_atomic
from diagnostics.report.hang_card import hang_markdown, hang_text
from diagnostics.report.tensorboard import log_text, spread
from diagnostics.report.topology_card import topology_markdown
from lightning_nd.runtime.job import store_prefix

_fits = itertools.count()  # every rank counts its fits alike: one store prefix per fit


class CollectiveMonitor(Callback):
    def __init__(self, log_dir: str | None = None, flight_recorder_entries: int | None = None,
                 distributed_debug: Literal["INFO", "DETAIL"] | None = None, gather_timeout: float = 12.0,
                 log_every_n_steps: int = 50) -> None:
        """``log_dir``: where ``diagnostics/`` goes (default: the Trainer's ``default_root_dir``, the same on every
        rank before any logger has a version). ``flight_recorder_entries``: the ring's size (default 2000; 0 turns
        it off). ``distributed_debug``: sets ``TORCH_DISTRIBUTED_DEBUG`` (``DETAIL`` checks every collective's
        shapes across ranks: a mismatch stops at once, at a cost). ``gather_timeout``: how long a failing rank
        waits for the others' captures. ``log_every_n_steps``: how often the time each rank waits in the
        strategy's own collectives (loss reduction, clipping norm) is logged, as ``collectives/strategy_wait_s``
        mean / min / max across ranks per step (0: never; one small all-gather each time)."""
        if distributed_debug not in (None, "INFO", "DETAIL"):
            raise ValueError(f"`CollectiveMonitor(distributed_debug={distributed_debug!r})` is not a level."
                             " HINT: use None, \"INFO\" or \"DETAIL\".")
        if flight_recorder_entries is not None and flight_recorder_entries < 0:
            raise ValueError(f"`CollectiveMonitor(flight_recorder_entries={flight_recorder_entries})` must be >= 0.")
        if not isinstance(log_every_n_steps, int) or log_every_n_steps < 0:
            raise ValueError(f"`CollectiveMonitor(log_every_n_steps={log_every_n_steps!r})` must be an int >= 0.")
        self._log_dir, self._entries, self._debug = log_dir, flight_recorder_entries, distributed_debug
        self.every, self._waited, self._logged_step = log_every_n_steps, 0.0, 0
        self.gather_timeout = gather_timeout
        self.folder: Path | None = None
        self.rank, self.world_size, self.backend = 0, 1, ""
        self.kept: dict[str, str] = {}
        self.groups: tuple[GroupRecord, ...] = ()
        self.coordinates: dict[str, dict[str, int]] = {}
        self.roles: dict[str, list[list[int]]] = {}
        self.ledger = PointToPointLedger()
        self.exchange: CaptureExchange | None = None
        self.report = None
        self._trainer: Trainer | None = None
        self._lock, self._captured, self._topology_written = threading.Lock(), False, False

    # ---- before and after the process group ------------------------------------------------------------------

    def on_nd_before_process_group(self, strategy: Any, event: Any) -> None:
        self.rank, self.world_size, self.backend = event.rank, event.world_size, event.backend
        self.ledger, self.report, self._captured, self._topology_written = PointToPointLedger(), None, False, False
        self.folder = Path(self._log_dir or event.root_dir).resolve() / "diagnostics"
        own_folder = self.folder / f"rank{self.rank}"
        own_folder.mkdir(parents=True, exist_ok=True)
        stale = [own_folder / CAPTURE_FILE, own_folder / "stacks.txt", own_folder / "hang.md",
                 self.folder / "fr" / f"{DUMP_PREFIX}{self.rank}",
                 *(self.folder / "nccl").glob(f"nccl.rank{self.rank}.*")]
        for path in stale + ([self.folder / HANG_FILE] if self.rank == 0 else []):
            path.unlink(missing_ok=True)  # what an earlier run in this folder left must not be read as this one's
        wanted = wanted_environment(event.backend, self.rank, self.folder, self._entries, self._debug)
        _, self.kept = apply_environment(wanted, os.environ)
        if self.kept and self.rank == 0:
            print("lightning-nd diagnostics: keeping your " + ", ".join(f"{k}={v}" for k, v in self.kept.items())
                  + f" (CollectiveMonitor would set {', '.join(f'{k}={wanted[k]}' for k in self.kept)})",
                  file=sys.stderr)
        if not faulthandler.is_enabled():  # a rank killed by an abort (gloo's size check) still leaves its stacks
            self._fault_file = open(own_folder / "faulthandler.txt", "w")
            faulthandler.enable(self._fault_file, all_threads=True)

    def on_nd_process_groups_created(self, strategy: Any, event: Any) -> None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        self.groups = tuple(GroupRecord(g.name, g.desc, g.role, tuple(g.ranks)) for g in event.groups)
        store = _get_default_store().clone() if dist.is_initialized() and self.world_size > 1 else None
        if store is not None:
            store.set_timeout(timedelta(seconds=5))  # a host gone without closing its socket: no long block
        prefix = f"{store_prefix('diagnostics')}{next(_fits)}/"  # a restarted generation starts clean
        assert self.folder is not None
        self.exchange = CaptureExchange(store, prefix, self.folder, self.rank, self.world_size)
        self.exchange.put(f"host/{self.rank}", f"{socket.gethostname()}|{os.getpid()}")

    def on_nd_layout_ready(self, strategy: Any, event: Any) -> None:
        self.coordinates = {str(h.rank): dict(h.coordinates) for h in event.layout.ranks}
        self.roles = {role: [list(g) for g in groups] for role, groups in event.layout.roles.items()}
        if self.rank == 0 and self.folder is not None:
            write_atomic(self.folder / "layout.json", event.layout.to_json(indent=1))

    def on_nd_point_to_point(self, strategy: Any, event: Any) -> None:
        step = self._trainer.global_step if self._trainer is not None else 0
        self.ledger.add(event.op, event.peer, event.role, event.state, step, event.tag, event.bytes, event.time_s)

    # ---- Lightning hooks --------------------------------------------------------------------------------------

    def on_nd_collective_wait(self, strategy: Any, event: Any) -> None:
        self._waited += event.seconds

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        view = TroubleshootingView.of(trainer)
        if view is not None and self.every:
            view.margin("collectives", "strategy's collectives: wait per step (s)", "collectives/strategy_wait_s")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._trainer = trainer

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._waited, self._logged_step = 0.0, trainer.global_step  # after a resume has restored the step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every and step % self.every == 0 and step > self._logged_step:
            self._log_waits(trainer, pl_module, step)
        if self._topology_written or self.folder is None:
            return
        self._topology_written = True  # after the first step: NCCL creates its communicators lazily
        if self.rank == 0 and self.exchange is not None:
            log_text(trainer, "diagnostics/topology", self._topology())

    def _log_waits(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        everyone = gather_floats([self._waited / (step - self._logged_step)], pl_module.device, trainer.world_size)
        self._waited, self._logged_step = 0.0, step
        for logger in trainer.loggers if trainer.global_rank == 0 else ():
            logger.log_metrics(spread("collectives/strategy_wait_s", [v[0] for v in everyone]), step=step)

    def _topology(self) -> str:
        hosts = {}
        for rank in range(self.world_size):
            value = self.exchange.read(f"host/{rank}")
            host, _, pid = (value or f"{socket.gethostname()}|{os.getpid()}").partition("|")
            hosts[rank] = (host[:200], int(pid) if pid.isdigit() and len(pid) <= 10 else -1)  # a peer's, unchecked
        address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        card = topology_markdown(self.backend, address, _store_host(), hosts, self.roles)
        nccl = self.folder / "nccl"
        if "nccl" in self.backend and nccl.is_dir():
            from diagnostics.analysis.nccl_findings import nccl_findings, topology_table
            from diagnostics.analysis.nccl_log import parse_nccl_dir
            from diagnostics.report.nccl_card import nccl_markdown

            logs = parse_nccl_dir(nccl)
            card += "\n\n" + nccl_markdown(logs, nccl_findings(logs, self.roles), topology_table(logs, self.roles))
        return card

    # ---- the failure ------------------------------------------------------------------------------------------

    def on_nd_failure_verdict(self, strategy: Any, event: Any) -> None:
        with self._lock:
            if self._captured or self.folder is None:
                return
            self._captured = True
        raised = event.thread == threading.main_thread().name  # this rank's own step raised
        own_error = raised and event.culprit == self.rank and not event.communication
        capture = self._capture(f"rank {event.culprit} {event.reason}", raised and not own_error,
                                event.reason if own_error else "")
        assert self.exchange is not None
        self.exchange.publish(capture)
        dead = {event.culprit} if event.reason.startswith("died") else set()
        captures = self.exchange.gather(dead, self.gather_timeout)
        self.report = hang_report(captures, self.world_size, dead, capture.reason)
        print(hang_text(self.report, str(self.folder)), file=sys.stderr, flush=True)
        card = hang_markdown(self.report, str(self.folder))
        write_atomic(self.folder / f"rank{self.rank}" / "hang.md", card)  # this rank's view, even if it is alone
        if self.rank == min(captures, default=self.rank):
            write_atomic(self.folder / HANG_FILE, to_json(self.report))
        if self.rank == 0 and self._trainer is not None:
            log_text(self._trainer, "diagnostics/hang", card)
        self.exchange.done()
        if self.rank == _store_host():
            self.exchange.wait_until_read([r for r in range(self.world_size) if r not in dead], seconds=3.0)

    def _capture(self, reason: str, raised: bool, error: str) -> RankCapture:
        assert self.folder is not None
        dump = read_dump()
        stacks, main = thread_stacks()
        write_atomic(self.folder / f"rank{self.rank}" / "stacks.txt", stacks_text(stacks))
        torch_dumped = "nccl" in self.backend and (self.folder / "fr" / f"{DUMP_PREFIX}{self.rank}").exists()
        if dump is not None and not torch_dumped:  # on NCCL torch may have dumped on the timeout itself
            write_dump(with_groups(dump, self.groups, self.rank), self.folder / "fr", self.rank)
        step = self._trainer.global_step if self._trainer is not None else 0
        return RankCapture(self.rank, self.world_size, reason, step, time.time(), entries_of(dump) if dump else (),
                           self.ledger.records(), stacks, main, self.groups, self.coordinates,
                           flight_recorder=dump is not None, raised=raised, error=error)


def _store_host() -> int | None:
    """Rank 0's process hosts the store under Lightning's launcher; torchrun's agent hosts it otherwise."""
    return None if os.environ.get("TORCHELASTIC_RUN_ID") else 0
