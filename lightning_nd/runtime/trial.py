"""Whether the forward running now is a trial: torch's pipelining runs every stage once before the first step to
learn its shapes (`lightning_nd.pipeline_parallel.shape_inference`). A trial is no training step's forward: the MoE
layers do not count its routing, nor does the `RoutingMonitor`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import wraps
from typing import Any

_TRIAL: ContextVar[bool] = ContextVar("lightning_nd_trial_forward", default=False)


def in_trial_forward() -> bool:
    return _TRIAL.get()


@contextmanager
def trial_forward() -> Iterator[None]:
    token = _TRIAL.set(True)
    try:
        yield
    finally:
        _TRIAL.reset(token)


def as_trial(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, run as a trial forward."""

    @wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        with trial_forward():
            return function(*args, **kwargs)

    return run
