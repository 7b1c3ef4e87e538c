"""What the bottleneck probe records: each rank's time per step split into phases and exposed communication per
mesh role, the window's context, and the diagnosis (``<log_dir>/diagnostics/bottleneck.jsonl``, one window a line).

The contract between `diagnostics.callbacks.bottleneck_monitor` (live), `diagnostics.analysis.trace` (profiler
traces, live and offline), `diagnostics.analysis.bottleneck` (the classifier) and ``python -m diagnostics trace``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PHASES = ("data_wait", "forward", "backward", "optimizer", "pipeline_idle", "waiting", "host")
"""Where a rank's step goes, communication carved out: ``data_wait`` the loader's fetch; ``forward``,
``backward``, ``optimizer`` their compute only; ``pipeline_idle`` a pipeline stage waiting for its neighbours;
``waiting`` blocked in a collective for a slower rank (the part of a collective's time beyond the group's fastest
member's); ``host`` time in none of them (Lightning's hooks, Python between phases; on a GPU, the device idle
inside a phase). The exposed communication per role is apart, in `RankTimes.comm`."""
LABELS = ("data-bound", "compute-bound", "communication-bound", "pipeline-bubble", "straggler", "host-bound",
          "not-enough-evidence")
"""``not-enough-evidence``: a window of several ranks without a profiled step (``WindowContext.profiled`` False),
whose times cannot tell waiting inside a collective from compute, would otherwise have been called compute-bound."""


@dataclass(frozen=True)
class RankTimes:
    """One rank's mean step over a window, in seconds per optimizer step."""

    rank: int
    steps: int
    """Optimizer steps the means are over."""
    step_s: float
    """Wall time of one step: from the end of the previous optimizer step to the end of this one."""
    phases: dict[str, float]
    """Every key of `PHASES`."""
    comm: dict[str, float]
    """Exposed communication (not hidden under compute) per mesh role (``tp``, ``fsdp``, ``dp_replicate``, ``cp``,
    ``ep``, ``pp``, ``world``, ``other``...). As measured it includes the wait for slower ranks; the classifier
    moves that part to ``phases['waiting']`` (`diagnostics.analysis.bottleneck.attribute_waiting`)."""
    residual_s: float
    """``step_s`` minus the phases and the communication: what they do not explain (may be negative)."""


@dataclass(frozen=True)
class WindowContext:
    """What the classifier and its advice know about the run besides the times."""

    first_step: int
    last_step: int
    dims: dict[str, int]
    """pp, dp_replicate, dp_shard, cp, tp, ep (1 where unused)."""
    roles: dict[str, list[list[int]]] = field(default_factory=dict)
    """Mesh role -> its groups of global ranks (the Layout's ``roles``); a collective's wait for slower ranks is
    measured inside the group."""
    pp_schedule: str | None = None
    pp_microbatches: int | None = None
    pp_stages_per_rank: int = 1
    """Stages each pp rank runs, as the Layout resolved them (1 for gpipe and 1f1b): the bubble formula's v."""
    num_workers: int | None = None
    """The training loader's ``num_workers`` (None: unknown)."""
    hosts: dict[int, str] = field(default_factory=dict)
    """Global rank -> host name, when known (a group spanning hosts communicates over the network)."""
    host_cores: dict[str, int] = field(default_factory=dict)
    """Host -> the CPU cores its processes may run on (the union of their affinity), when known."""
    shared_gpus: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """GPU (its UUID) -> the ranks using it, for each GPU more than one rank uses."""
    tokens_per_s: float | None = None
    """Throughput over the batch ranks only (each sample counted once, not once per tp/cp/pp rank)."""
    mfu: float | None = None
    """Model FLOPs utilisation against the hardware preset's peak (`lightning_nd.cost.hardware`)."""
    profiled: bool | None = None
    """Whether a step of the window was profiled (its communication split out of the phases); None: not said."""
    options: dict[str, Any] = field(default_factory=dict)
    """The Layout's options (``activation_checkpointing``, ``compile``, ``sequence_parallel``...) and the
    Trainer's ``precision``: what the advice need not suggest again."""


@dataclass(frozen=True)
class Diagnosis:
    """What limits a window's steps, the evidence and what to do about it."""

    label: str
    """One of `LABELS`."""
    shares: dict[str, float]
    """Fraction of the mean step (over ranks) per phase, per ``comm:<role>`` and ``residual``."""
    evidence: str
    """One sentence: the numbers the label rests on."""
    advice: tuple[str, ...]
    """In practitioners' terms, with the window's numbers; the most useful first."""
    dim: str | None = None
    """communication-bound: the role whose communication dominates."""
    rank: int | None = None
    """straggler: the slow rank."""
    phase: str | None = None
    """straggler: the phase it is slow in."""
    residual: float = 0.0
    """Share of the step the phases do not explain (reported apart, never folded into a class)."""
    findings: tuple[str, ...] = ()
    """Beside the label: what makes the window's times unlike the run's on its own hardware (a shared host)."""


@dataclass(frozen=True)
class WindowRecord:
    """One line of ``bottleneck.jsonl``."""

    context: WindowContext
    ranks: tuple[RankTimes, ...]
    """One per rank, by rank (ranks are unique)."""
    diagnosis: Diagnosis
