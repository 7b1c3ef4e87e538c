"""Lightning's own launcher (``python train.py`` with ``Trainer(devices=N)``), with an observer that lets the ranks
finish their reports before it ends them.

Lightning's `_ChildProcessObserver` (``lightning/fabric/strategies/launchers/subprocess_script.py``) polls the
processes it started every 5 s and, once one has exited non-zero, SIGKILLs every other one and its own process
(rank 0): a rank still writing its report (the memory card, the hang verdict, the run record) is cut short, and one
SIGKILLed from outside (the kernel's out-of-memory killer) cannot wait for the others. Here, once one has failed, the
others get ``grace_s`` to end by themselves (each does once every rank has acknowledged the verdict:
`lightning_nd.runtime.watchdog`); only what still runs then is killed, as Lightning would.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

log = logging.getLogger("lightning_nd")


class PatientObserver(_ChildProcessObserver):
    """Lightning's observer, except that after the first failed child it waits ``grace_s`` (plus one poll) before it
    kills what still runs; a process that ends by itself meanwhile is not killed."""

    def __init__(self, main_pid: int, child_processes: list[subprocess.Popen], grace_s: float,
                 sleep_period: int = 5) -> None:
        super().__init__(main_pid=main_pid, child_processes=child_processes, sleep_period=sleep_period)
        self.grace_s = grace_s
        self._failed_at: float | None = None

    @override
    def _run(self) -> bool:
        codes = [proc.poll() for proc in self._child_processes]
        if self._failed_at is None:
            if all(code == 0 for code in codes):
                return True
            failed = next((index for index, code in enumerate(codes) if code), None)
            if failed is None:
                return False
            self._failed_at = time.monotonic()
            log.warning(f"lightning-nd: local rank {failed + 1}'s process exited with {codes[failed]}; the others get"
                        f" {self.grace_s:.0f} s to write their reports and end before they are killed")
        if time.monotonic() - self._failed_at < self.grace_s:
            return False
        self._terminate_all()
        return True


class PatientLauncher(_SubprocessScriptLauncher):
    """`_SubprocessScriptLauncher` watching its children with `PatientObserver`."""

    def __init__(self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int,
                 grace_s: float) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.grace_s = grace_s

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # As Lightning's `launch`, with the patient observer.
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            PatientObserver(os.getpid(), self.procs, self.grace_s).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


def patient(launcher: Any, grace_s: float | None) -> Any:
    """Lightning's own launcher, patient; any other launcher (torchrun's, SLURM's, a user's own) as it is, and
    Lightning's too when there is nothing to wait for (``grace_s`` None: no watchdog)."""
    if type(launcher) is not _SubprocessScriptLauncher or grace_s is None:
        return launcher
    return PatientLauncher(launcher.cluster_environment, launcher.num_processes, launcher.num_nodes, grace_s)
