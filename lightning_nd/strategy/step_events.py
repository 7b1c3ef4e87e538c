"""What `NDParallel` reports from inside a step: phase times, the pipeline's point-to-point operations and
timings and its own collectives' waits. Nothing is measured when nobody listens.

Phase times are host wall-clock (``time.perf_counter``); on CUDA the forward/backward/optimizer phases are
closed after a device synchronise, so they are device time, at the cost of the overlap between steps
(only while someone listens). ``data_wait`` is the time from the end of the previous backward or optimizer
step (or the start of fit) to the moment a training batch reaches the strategy: the loader's fetch and
Lightning's hooks. ``optimizer`` runs from the end of the last backward to the end of the optimizer step
(clipping included): Lightning runs forward and backward inside its optimizer step (a closure). Under
manual optimization the optimizer steps inside ``forward``, which then includes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_nd.runtime.profiling import comm_label, phase_label
from lightning_nd.strategy.events import (
    CollectiveWait,
    EventBus,
    PointToPoint,
    StageTiming,
    StepPhase,
)


class StepEvents:
    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self.device = torch.device("cpu")
        self._global_step: Callable[[], int] = lambda: 0
        self._idle_since: float | None = None
        self._backward_end = 0.0

    def attach(self, device: torch.device, global_step: Callable[[], int]) -> None:
        """A fit begins: its device, and where the Trainer keeps its step count."""
        self.device, self._global_step = device, global_step

    @property
    def step(self) -> int:
        return self._global_step()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def batch_arrived(self) -> None:
        if self._idle_since is not None and self.bus.wants(StepPhase):
            now = time.perf_counter()
            self.bus.emit(StepPhase(self.step, "data_wait", self._idle_since, now - self._idle_since))
        self._idle_since = None

    def start_waiting(self) -> None:
        """The step (or fit's start) is over: what follows until the next batch is data wait."""
        self._idle_since = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Generator[None, None, None]:
        if not self.bus.wants(StepPhase):
            with phase_label(name):
                yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            with phase_label(name):
                yield
        finally:
            self._sync()
            self.bus.emit(StepPhase(self.step, name, start, time.perf_counter() - start))

    @contextmanager
    def collective(self, op: str, role: str) -> Generator[None, None, None]:
        """Time the strategy's own collective (a reduction, a barrier): the wait for the slowest rank."""
        if not self.bus.wants(CollectiveWait):
            with comm_label(role, op):
                yield
            return
        start = time.perf_counter()
        try:
            with comm_label(role, op):
                yield
        finally:
            self.bus.emit(CollectiveWait(op, role, time.perf_counter() - start))

    def report(self, role: str) -> Callable[[str, dict[str, Any]], None] | None:
        """A ``report(kind, fields)`` callback for the pipeline runner and ring attention; None if nobody listens."""
        if not (self.bus.wants(StepPhase) or self.bus.wants(PointToPoint)):
            return None

        def report(kind: str, fields: dict[str, Any]) -> None:
            if kind == "phase" and self.bus.wants(StepPhase):
                self.bus.emit(StepPhase(self.step, fields["phase"], fields["start_s"], fields["duration_s"],
                                        microbatch=fields["microbatch"], stage=fields["stage"]))
            elif kind == "p2p" and self.bus.wants(PointToPoint):
                tag = f"{fields.get('direction', '')}{'/' + str(fields['chunk']) if 'chunk' in fields else ''}"
                self.bus.emit(PointToPoint(fields["op"], fields["peer"], role, fields["state"], fields["bytes"],
                                           fields["time_s"], tag))

        return report

    def step_done(self, pipeline_timings: dict[str, float]) -> None:
        """After a training step's forward/backward: the pipeline's timings."""
        if pipeline_timings and self.bus.wants(StageTiming):
            self.bus.emit(StageTiming(self.step, pipeline_timings["step_s"], pipeline_timings["compute_s"],
                                      pipeline_timings["idle_s"]))

    def backward_done(self) -> None:
        self._backward_end = time.perf_counter()
        self.start_waiting()

    @contextmanager
    def optimizer(self) -> Generator[None, None, None]:
        """The optimizer step, from the end of the backward inside it (or its own start) to its end."""
        start = time.perf_counter()
        with phase_label("optimizer"):
            yield
        if self.bus.wants(StepPhase):
            self._sync()
            begun = max(start, self._backward_end)
            self.bus.emit(StepPhase(self.step, "optimizer", begun, time.perf_counter() - begun))
        self.start_waiting()
