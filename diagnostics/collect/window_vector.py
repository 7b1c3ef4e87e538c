"""One rank's bottleneck window as a fixed-length list of floats, for the window's one all-gather, and back:
steps, step_s, every phase, the exposed communication per role of `ROLES`, the residual, the tokens this rank
saw and the full sequence length. Only this module knows the positions."""

from __future__ import annotations

from diagnostics.records import PHASES, RankTimes
from lightning_nd.mesh.roles import EXPERT_ROLES, ROLE_DIMS

ROLES = (*ROLE_DIMS, *EXPERT_ROLES, "world", "group", "other")
"""The roles a rank's communication is gathered under (a trace's unknown role counts as ``other``)."""


def window_vector(times: RankTimes | None, tokens: list[int]) -> list[float]:
    """``times`` None: this rank closed no step in the window (its figures are left out on rank 0)."""
    if times is None:
        return [0.0] * (3 + len(PHASES) + len(ROLES)) + [float(tokens[0]), float(tokens[1])]
    comm = dict.fromkeys(ROLES, 0.0)
    for role, seconds in times.comm.items():
        comm[role if role in comm else "other"] += seconds
    return [float(times.steps), times.step_s, *[times.phases[p] for p in PHASES], *comm.values(), times.residual_s,
            float(tokens[0]), float(tokens[1])]


def rank_times_of(rank: int, values: list[float]) -> RankTimes | None:
    steps, step_s = int(values[0]), values[1]
    if steps == 0:
        return None
    phases = dict(zip(PHASES, values[2:2 + len(PHASES)]))
    comm_values = values[2 + len(PHASES):2 + len(PHASES) + len(ROLES)]
    comm = {role: seconds for role, seconds in zip(ROLES, comm_values) if seconds > 0}
    return RankTimes(rank=rank, steps=steps, step_s=step_s, phases=phases, comm=comm, residual_s=values[-3])


def tokens_of(values: list[float]) -> float:
    """The tokens the rank saw in the window (``tokens[0]`` of `window_vector`)."""
    return values[-2]


def sequence_length_of(values: list[float]) -> int:
    """The full sequence length of the window's last batch (``tokens[1]`` of `window_vector`)."""
    return int(values[-1])
