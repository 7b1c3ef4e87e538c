"""What the collective probe records when a run fails (``<log_dir>/diagnostics/rank<R>/capture.json``) and the
hang verdict over every rank's capture (``hang.json``): flight-recorder entries, the point-to-point ledger, each
thread's stack, the rank's process groups, and the culprits.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    name: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.name}"


@dataclass(frozen=True)
class CollectiveEntry:
    """One collective as the flight recorder saw it on one rank."""

    group: str
    """The process group's name (``'1'``), as in the Layout's process-group records."""
    seq: int
    """The group's collective sequence number (per group, counted by every member)."""
    op: str
    """``all_reduce``, ``all_gather_into_tensor``, ... (the backend prefix removed)."""
    input_sizes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    retired: bool
    """Completed on this rank (on gloo the only sign of completion: ``state`` stays ``scheduled``)."""
    started_ns: int | None
    """Wall clock (ns since the epoch) when the rank issued it."""
    frames: tuple[Frame, ...] = ()
    """Python frames, innermost first, down to the user's line."""


@dataclass(frozen=True)
class PointToPointRecord:
    """One send or receive from the strategy's ledger (the flight recorder misses them on gloo)."""

    op: str
    """send or recv."""
    peer: int
    role: str
    """pp or cp."""
    state: str
    """issued or completed."""
    step: int
    tag: str
    """Direction and microbatch under pp (``fwd/2``); empty for ring attention hops."""
    bytes: int
    time_s: float


@dataclass(frozen=True)
class GroupRecord:
    """A process group this rank belongs to, with its mesh role (``world`` for the default group)."""

    name: str
    desc: str
    role: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class RankCapture:
    """Everything one live rank wrote when the run failed."""

    rank: int
    world_size: int
    reason: str
    """The run's verdict as this rank received it (``rank 3 died: ...``)."""
    step: int
    captured_at: float
    """Wall clock (s since the epoch)."""
    entries: tuple[CollectiveEntry, ...]
    point_to_point: tuple[PointToPointRecord, ...]
    stacks: dict[str, tuple[Frame, ...]]
    """Every thread's Python stack, innermost first, by thread name."""
    main_thread: str
    groups: tuple[GroupRecord, ...]
    coordinates: dict[str, dict[str, int]] = field(default_factory=dict)
    """Every rank's mesh coordinates (``{"3": {"pp": 0, "dp_shard": 1, "tp": 1}}``), from the Layout."""
    flight_recorder: bool = True
    """False when the flight recorder was off (``TORCH_FR_BUFFER_SIZE=0``) or could not be read."""
    raised: bool = False
    """This rank's own step raised a communication error (a timeout, a broken connection): it was waiting. Its
    main thread's stack is then the capture's, and the collective it waited in is marked retired by then."""
    error: str = ""
    """This rank's own error when it failed by itself (not a communication error): it is a culprit."""


@dataclass(frozen=True)
class Culprit:
    rank: int
    kind: str
    """never_joined, skipped, mismatch, stuck, dead, never_sent, never_received."""
    dim: str
    """The mesh role of the group (``tp``, ``dp_shard``, ``pp``, ``world``)."""
    group_ranks: tuple[int, ...]
    op: str
    seq: int | None
    frame: str | None
    """Where the rank is (its stack) or where the op is called (its peers' frames), ``file:line in function``."""
    waited_s: float | None
    """How long the ranks that did join had waited when they were captured."""
    detail: str


@dataclass(frozen=True)
class HangReport:
    culprits: tuple[Culprit, ...]
    dead: tuple[int, ...]
    captured: tuple[int, ...]
    missing: tuple[int, ...]
    """Ranks without a capture (dead, or the store and the shared folder both unreachable)."""
    summary: tuple[str, ...]
    """One sentence per culprit in mesh terms, then the consequences."""
    reason: str = ""
