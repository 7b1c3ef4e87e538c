"""Hand-built bottleneck windows shared by test_bottleneck_analysis.py and test_bottleneck_advice.py: a rank's
step from its parts, a window's context, balanced ranks, and eight ranks with one straggler."""

from __future__ import annotations

from diagnostics.records import PHASES, RankTimes, WindowContext

DIMS = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1}


def times(rank: int, comm: dict[str, float] | None = None, residual: float = 0.0, step: float | None = None,
          **phases: float) -> RankTimes:
    """A rank's step; ``step`` defaults to what its parts add up to."""
    comm = dict(comm or {})
    full = {phase: 0.0 for phase in PHASES} | phases
    total = sum(full.values()) + sum(comm.values()) + residual
    return RankTimes(rank, 10, total if step is None else step, full, comm, residual)


def context(dims: dict[str, int] | None = None, **fields) -> WindowContext:
    return WindowContext(first_step=0, last_step=10, dims=DIMS | (dims or {}), **fields)


def eight_ranks_one_slow(slow_forward: float = 0.32) -> list[RankTimes]:
    """Rank 5 is slow in forward; the others wait for it inside FSDP's collectives."""
    extra = slow_forward - 0.20
    return [times(r, {"fsdp": 0.05 + (0.0 if r == 5 else extra)}, forward=slow_forward if r == 5 else 0.20,
                  backward=0.10, optimizer=0.02, host=0.01) for r in range(8)]


def balanced(**phases: float) -> list[RankTimes]:
    return [times(r, **phases) for r in range(4)]
