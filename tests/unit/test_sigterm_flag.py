"""SIGTERM during an `NDParallel` fit (`lightning_nd/strategy/sigterm.py`): forwarded to the launcher's children and
flagged for Lightning's loop as Lightning's own handler does (the reference), but with no collective inside the
handler, which torchrun's SIGTERM would otherwise raise into (or hold up) a rank's failure report; a handler the user
had registered before the run still runs."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

from lightning_nd.strategy.sigterm import flag_sigterm


class _Launcher:
    def __init__(self) -> None:
        self.sent: list[int] = []

    def kill(self, signum: int) -> None:
        self.sent.append(signum)


@pytest.fixture
def run(monkeypatch):
    """What the handlers read of a Trainer of 2 ranks, with Lightning's handlers registered as a run registers them;
    ``dist.broadcast`` is recorded instead of run."""
    users: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: users.append(signum))
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=_Launcher(), root_device=torch.device("cpu")),
                              world_size=2, local_rank=0,
                              _accelerator_connector=SimpleNamespace(cluster_environment=LightningEnvironment()))
    trainer._signal_connector = _SignalConnector(trainer)
    trainer._signal_connector.register_signal_handlers()
    broadcasts: list[int] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "broadcast", lambda tensor, src: broadcasts.append(src))
    yield trainer, users, broadcasts
    trainer._signal_connector.teardown()
    signal.signal(signal.SIGTERM, before)


def _sigterm_twice(trainer) -> None:
    for _ in range(2):
        signal.raise_signal(signal.SIGTERM)
    assert trainer._signal_connector.received_sigterm


def test_lightnings_handler_runs_a_collective_inside_the_handler(run):
    trainer, users, broadcasts = run
    _sigterm_twice(trainer)
    assert broadcasts == [0, 0]
    assert trainer.strategy.launcher.sent == [signal.SIGTERM] and users == [signal.SIGTERM] * 2


def test_ours_forwards_and_flags_alike_without_a_collective(run):
    trainer, users, broadcasts = run
    flag_sigterm(trainer)
    _sigterm_twice(trainer)
    assert broadcasts == []
    assert trainer.strategy.launcher.sent == [signal.SIGTERM] and users == [signal.SIGTERM] * 2
