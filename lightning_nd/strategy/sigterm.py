"""SIGTERM during an `NDParallel` fit: forwarded and noted, never answered with a collective inside the handler.

Lightning's handler (`_SignalConnector._sigterm_notifier_fn`,
``lightning/pytorch/trainer/connectors/signal_connector.py``) forwards the signal to its launcher's children, then
runs ``dist.broadcast`` inside the signal handler, wherever the main thread was, and reads nothing from it (the loop
broadcasts rank 0's flag at every batch start: ``training_epoch_loop._broadcast_sigterm_tensor``). torchrun's agent
sends SIGTERM to every worker as soon as one exits non-zero (``SubprocessContext._poll`` closes them all: SIGTERM,
SIGKILL 30 s later): a rank then handling the failure gets that broadcast's error raised into its report (a
listener's card lost, a heartbeat check read as a lost store), or waits in it until the process-group timeout, past
the agent's SIGKILL. Here the handler forwards the signal and sets the flag as Lightning's does, so a healthy run
still stops on every rank at the same batch (``SIGTERMException``); the handlers composed with Lightning's (a user's
own, SLURM's) still run after it.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector


def flag_sigterm(trainer: Trainer) -> None:
    """Replace Lightning's SIGTERM handler for this run (registered as the run started, on the main thread; Lightning
    restores the handlers it found when the run ends)."""
    current = signal.getsignal(signal.SIGTERM)
    if os.name == "nt" or threading.current_thread() is not threading.main_thread() or not isinstance(
            current, _HandlersCompose):
        return
    others: list[Any] = [handler for handler in current.signal_handlers if callable(handler)
                         and getattr(handler, "__func__", None) is not _SignalConnector._sigterm_notifier_fn]
    connector: _SignalConnector = trainer._signal_connector

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        launcher: Any = trainer.strategy.launcher
        if not connector.received_sigterm and launcher is not None:
            launcher.kill(signum)
        connector.received_sigterm = True
        for handler in others:
            handler(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)
