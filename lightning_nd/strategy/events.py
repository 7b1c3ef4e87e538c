"""Typed events from inside an `NDParallel` run, for diagnostics to subscribe to (nothing private needed).

A listener is any object with a method named by an event's ``hook`` (e.g. ``on_nd_layout_ready(strategy,
event)``): the Trainer's callbacks that have one are subscribed when fit starts, anything else with
``strategy.events.subscribe(listener)``. Events nobody listens to are never built (`EventBus.wants` is a
dict lookup), so an unobserved run pays nothing measurable (``benchmarks/overhead.py``, row "events").

Who delivers what, and when:
- `BeforeProcessGroup`: in every rank's process, before ``init_process_group`` (set NCCL / flight-recorder
  variables there; a later fit in the same process finds the group started); `ProcessGroupsCreated` right
  after the mesh is built; `LayoutReady` in ``setup``, before the composer applies the Layout; `LayoutApplied`
  right after it (what the composer applied, the rank table, the model's shape).
- `StepPhase` (data_wait, forward, backward, optimizer; per microbatch under pp), `StageTiming`,
  `PointToPoint` (issued / completed, by our code and by the pipeline schedule), `CollectiveWait` (the
  strategy's own collectives: loss and metric reductions, the clipping norm), `CheckpointSaved` /
  `CheckpointLoaded`: on the main thread. Steps are
  the Trainer's ``global_step``. Under ``async_save`` a checkpoint commits in the background; its
  `CheckpointCommitted` is delivered on the main thread when it next looks: at the next training step, save,
  checkpoint removal or the end of training.
- `MemoryPlanned`: at the first training batch, on the main thread (the pre-flight: `strategy/preflight.py`).
- `OutOfMemory`, then `FailureVerdict` (once per rank): before the process exits. A rank's own failure, or
  a peer's death seen first by the main thread, is delivered on the main thread; a peer's death seen by the
  watchdog (``thread`` = ``lightning-nd-watchdog``) is delivered while the watchdog waits at most
  ``VERDICT_BUDGET_S`` for the listeners (and the loggers' flush) before it ends the process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from lightning_nd.cost.shape import ModelShape
from lightning_nd.layout.record import Layout
from lightning_nd.runtime.errors import OUT_OF_MEMORY_WORDS

__all__ = ["OUT_OF_MEMORY_WORDS"]  # for listeners: how an out-of-memory error (or a peer's relayed one) reads

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy
    from torch import nn

log = logging.getLogger("lightning_nd")

VERDICT_BUDGET_S = 20.0


@dataclass(frozen=True)
class Event:
    hook: ClassVar[str] = ""


@dataclass(frozen=True)
class BeforeProcessGroup(Event):
    hook: ClassVar[str] = "on_nd_before_process_group"
    rank: int
    world_size: int
    backend: str
    root_dir: str
    """The Trainer's ``default_root_dir``: the same on every rank (loggers' versioned dirs are not yet known)."""


@dataclass(frozen=True)
class GroupInfo:
    name: str
    """The process group's name (as in flight-recorder dumps)."""
    desc: str
    role: str
    """A mesh role (`mesh/roles.py`) or ``world``."""
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ProcessGroupsCreated(Event):
    hook: ClassVar[str] = "on_nd_process_groups_created"
    groups: tuple[GroupInfo, ...]


@dataclass(frozen=True)
class LayoutReady(Event):
    hook: ClassVar[str] = "on_nd_layout_ready"
    layout: Layout
    model: nn.Module | None = field(default=None, compare=False, repr=False)
    """The whole model the Layout will split, before the composer touches it (on the meta device when
    `configure_model` built it there): read it during the call, never keep or change it."""


@dataclass(frozen=True)
class LayoutApplied(Event):
    hook: ClassVar[str] = "on_nd_layout_applied"
    layout: Layout
    applied: tuple[str, ...] | None
    """The composer's line per technique it applied (the "Applied ..." log lines), in its order; None when
    `configure_model` parallelized the model itself (the Layout is then what the plan would have done)."""
    rank_table: str
    """Every rank's coordinates on the mesh, as a markdown table."""
    shape: ModelShape | None
    """The whole model's sizes read before it was split (None when the cost model cannot read them)."""


@dataclass(frozen=True)
class StepPhase(Event):
    hook: ClassVar[str] = "on_nd_step_phase"
    step: int
    phase: str
    """data_wait, forward, backward, optimizer; under pp forward/backward/backward_weight per microbatch."""
    start_s: float
    """``time.perf_counter()`` when the phase began."""
    duration_s: float
    microbatch: int | None = None
    stage: int | None = None


@dataclass(frozen=True)
class StageTiming(Event):
    hook: ClassVar[str] = "on_nd_stage_timing"
    step: int
    step_s: float
    compute_s: float
    idle_s: float


@dataclass(frozen=True)
class PointToPoint(Event):
    hook: ClassVar[str] = "on_nd_point_to_point"
    op: str
    """send or recv."""
    peer: int
    """Global rank of the other side."""
    role: str
    """pp (the pipeline) or cp (ring attention)."""
    state: str
    """issued or completed."""
    bytes: int
    time_s: float
    tag: str = ""


@dataclass(frozen=True)
class CollectiveWait(Event):
    hook: ClassVar[str] = "on_nd_collective_wait"
    op: str
    role: str
    seconds: float


@dataclass(frozen=True)
class CheckpointSaved(Event):
    hook: ClassVar[str] = "on_nd_checkpoint_saved"
    path: str
    step: int | None
    seconds: float
    """How long the training loop waited: the whole save, or under ``async_save`` the staging (and any wait for the
    save before it to commit)."""
    committed: bool = True
    """False under ``async_save``: the checkpoint is still being written; `CheckpointCommitted` follows."""


@dataclass(frozen=True)
class CheckpointCommitted(Event):
    hook: ClassVar[str] = "on_nd_checkpoint_committed"
    path: str
    step: int | None
    seconds: float
    """From the ``save_checkpoint`` call until the checkpoint was whole (its manifest written, its folder in place)."""


@dataclass(frozen=True)
class CheckpointLoaded(Event):
    hook: ClassVar[str] = "on_nd_checkpoint_loaded"
    path: str
    resharded: bool
    seconds: float


@dataclass(frozen=True)
class MemoryPlanned(Event):
    hook: ClassVar[str] = "on_nd_memory_planned"
    rank: int
    expected: dict[str, Any]
    """This rank's `lightning_nd.cost.memory.RankMemory` for the first batch's shape, as a dict."""
    peak: dict[str, Any]
    """The same for the rank with the highest expected peak."""
    workload: dict[str, Any]
    """seq_len, batch (samples per forward on a batch rank), accumulation, precision."""
    optimizer: str
    alternatives: tuple[dict[str, Any], ...]
    """Changes that lower the peak: action, options, sizes (None: the same dims), detail, peak_bytes (the highest
    rank's), and the step they make: batch (samples per forward), accumulation."""
    capacity_bytes: int | None
    """The accelerator's memory (CUDA), None on CPU."""


@dataclass(frozen=True)
class OutOfMemory(Event):
    hook: ClassVar[str] = "on_nd_out_of_memory"
    rank: int
    message: str
    stage: str | None
    """The Trainer's stage (train, validate, ...) when it happened."""


@dataclass(frozen=True)
class FailureVerdict(Event):
    hook: ClassVar[str] = "on_nd_failure_verdict"
    culprit: int
    """The rank that failed or died."""
    reason: str
    rank: int
    """The rank delivering it."""
    thread: str
    communication: bool = False
    """This rank's own step broke on a communication error (a timeout, a lost peer): it was waiting, not at fault."""


ALL_EVENTS = (BeforeProcessGroup, ProcessGroupsCreated, LayoutReady, LayoutApplied, StepPhase, StageTiming,
              PointToPoint, CollectiveWait, CheckpointSaved, CheckpointCommitted, CheckpointLoaded, MemoryPlanned,
              OutOfMemory, FailureVerdict)


class EventBus:
    """Listeners by hook name; `emit` calls each with ``(sender, event)`` (the sender: the strategy); a listener's
    exception is logged and does not stop the run."""

    def __init__(self, sender: Strategy) -> None:
        self.sender = sender
        self._listeners: dict[str, list[object]] = {}
        self._subscribed: list[object] = []

    def subscribe(self, listener: object) -> None:
        if any(listener is known for known in self._subscribed):
            return
        self._subscribed.append(listener)
        for event in ALL_EVENTS:
            if callable(getattr(listener, event.hook, None)):
                self._listeners.setdefault(event.hook, []).append(listener)

    def wants(self, event_type: type[Event]) -> bool:
        return event_type.hook in self._listeners

    def emit(self, event: Event) -> None:
        for listener in self._listeners.get(event.hook, ()):
            try:
                getattr(listener, event.hook)(self.sender, event)
            except Exception:  # a diagnostic must never take the training run down with it
                log.exception("lightning-nd: listener %s failed on %s", type(listener).__name__, type(event).__name__)
