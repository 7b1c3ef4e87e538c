"""`NDParallel` under Lightning's own launcher: once a rank's process fails, the others get the failure monitor's grace
to write their reports and end by themselves (`lightning_nd/strategy/launcher.py`), where Lightning's observer (the
reference) SIGKILLs them at once. Real processes stand in for the ranks; the observers' polls are called directly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

from lightning_nd import NDParallel
from lightning_nd.runtime.watchdog import linger_bound
from lightning_nd.strategy.events import VERDICT_BUDGET_S
from lightning_nd.strategy.launcher import PatientLauncher, PatientObserver

KILLED = -9


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.fixture
def ranks(tmp_path: Path):
    """A rank that failed (exit 1), a rank still writing its report (it exits 1 once ``written`` exists) and a
    stand-in for the launcher's own process (rank 0), which the observers kill by pid."""
    written = tmp_path / "written"
    failed = _python("raise SystemExit(1)")
    reporting = _python(f"import pathlib, time\nwhile not pathlib.Path({str(written)!r}).exists(): time.sleep(0.01)\n"
                        "raise SystemExit(1)")
    main = _python("import time; time.sleep(120)")
    failed.wait()
    yield failed, reporting, main, written
    for proc in (reporting, main):
        proc.kill()
        proc.wait()


def test_lightnings_observer_kills_a_rank_still_reporting(ranks):
    failed, reporting, main, _ = ranks
    assert _ChildProcessObserver(main.pid, [failed, reporting])._run() is True
    assert reporting.wait(30) == KILLED and main.wait(30) == KILLED


def test_the_patient_observer_lets_it_end_by_itself_then_kills_what_is_left(ranks):
    failed, reporting, main, written = ranks
    observer = PatientObserver(main.pid, [failed, reporting], grace_s=600)
    assert observer._run() is False  # the failure is seen: the grace starts
    assert reporting.poll() is None and main.poll() is None
    written.touch()
    assert reporting.wait(30) == 1  # its own exit status: it finished its report
    assert observer._run() is False and main.poll() is None  # rank 0 too is left to end by itself
    observer.grace_s = 0  # the grace is over
    assert observer._run() is True
    assert main.wait(30) == KILLED


def test_healthy_children_are_left_alone():
    finished, running = _python("pass"), _python("import time; time.sleep(120)")
    finished.wait()
    try:
        assert PatientObserver(running.pid, [finished, running], grace_s=0)._run() is False
        assert running.poll() is None
    finally:
        running.kill()
        running.wait()


def test_ndparallel_makes_lightnings_launcher_patient_by_the_failure_monitors_grace(monkeypatch):
    for name in [*os.environ]:  # a process its launcher made (an earlier test's variables): Lightning makes no launcher
        if name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK") or name.startswith(
                ("TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "LSB_")):
            monkeypatch.delenv(name)
    trainer = Trainer(accelerator="cpu", devices=4, strategy=NDParallel(dp_shard=4, heartbeat_timeout=45), logger=False)
    launcher = trainer.strategy.launcher
    assert isinstance(launcher, PatientLauncher)
    assert launcher.grace_s == 45 + linger_bound(VERDICT_BUDGET_S)  # a death seen, then the verdict delivered by all
    assert (launcher.num_processes, launcher.num_nodes) == (4, 1)
    plain = Trainer(accelerator="cpu", devices=4, strategy=NDParallel(dp_shard=4, heartbeat_timeout=None), logger=False)
    assert type(plain.strategy.launcher) is _SubprocessScriptLauncher  # no watchdog: nothing to wait for
