"""Mesh roles: the groups of ranks each technique communicates over, as pure rank arithmetic.

One vocabulary for the whole project (the Layout, every JSON file, the benchmarks, the diagnostics):

- the dims ``pp, dp_replicate, dp_shard, cp, tp`` (outermost first) and ``ep``;
- ``batch``: ``dp_replicate x dp_shard``, the ranks that see different samples (sampler, metrics);
- ``fsdp``: ``dp_shard x cp``, the ranks FSDP shards parameters, gradients and optimizer state over;
- ``loss``: ``dp_replicate x dp_shard x cp``, the ranks a token-mean loss (and a logged value) averages over;
- ``hsdp``: the 2-D ``(dp_replicate, fsdp)`` mesh HSDP replicates and shards over;
- ``ep``: ranks borrowed from ``dp_shard x cp`` that hold different experts (``ep > 1`` only);
- ``expert_dp``: the ranks that hold the same experts and see different tokens (``ep > 1`` only).

`mesh/build.py` builds a `DeviceMesh` for every role; `role_groups` says which ranks each holds
without one, so a plan, a dry run and an offline tool agree with the running job.
"""

from __future__ import annotations

from lightning_nd.mesh.dims import MESH_DIMS, ParallelDims

# Which mesh dims vary inside one group of each role built from whole dims.
ROLE_DIMS: dict[str, tuple[str, ...]] = {
    **{name: (name,) for name in MESH_DIMS},
    "batch": ("dp_replicate", "dp_shard"),
    "fsdp": ("dp_shard", "cp"),
    "loss": ("dp_replicate", "dp_shard", "cp"),
    "hsdp": ("dp_replicate", "dp_shard", "cp"),
}
EXPERT_ROLES = ("ep", "expert_dp")
ROLE_MEANING = {
    "pp": "pipeline stages: point-to-point activations",
    "dp_replicate": "full replicas: gradient all-reduce",
    "dp_shard": "parameter shards",
    "cp": "sequence shards: ring attention",
    "tp": "weight-matrix shards: activation collectives",
    "batch": "different samples: sampler, metrics",
    "fsdp": "FSDP shards (dp_shard x cp): all-gather, reduce-scatter",
    "loss": "a token-mean loss averages over these (dp_replicate x dp_shard x cp)",
    "hsdp": "HSDP: replicate over dp_replicate, shard over fsdp",
    "ep": "different experts: token all-to-all",
    "expert_dp": "the same experts, different tokens: expert gradient reduction",
}


def role_names(dims: ParallelDims) -> list[str]:
    """The roles a run with these dims has (the expert roles only under ep)."""
    return [*ROLE_DIMS, *(EXPERT_ROLES if dims.ep > 1 else ())]


def _key(dims: ParallelDims, coords: dict[str, int], role: str) -> tuple:
    """What every rank of one group of ``role`` shares."""
    if role in ROLE_DIMS:
        return tuple(coords[name] for name in MESH_DIMS if name not in ROLE_DIMS[role])
    outer, inner = divmod(coords["dp_shard"], dims.dp_shard_in_ep)
    if role == "ep":
        return coords["pp"], coords["dp_replicate"], outer, coords["tp"]
    if role == "expert_dp":
        return coords["pp"], inner, coords["cp"], coords["tp"]
    raise KeyError(f"No role named {role!r}. Valid roles: {', '.join(role_names(dims))}.")


def role_groups(dims: ParallelDims, role: str) -> list[list[int]]:
    """Every group of ``role``: global ranks, each group in mesh order (a rank's index is its local rank)."""
    groups: dict[tuple, list[int]] = {}
    for rank in range(dims.world_size):
        groups.setdefault(_key(dims, dims.coordinates(rank), role), []).append(rank)
    # Every role is a slice of the row-major world mesh: mesh order is the order of global ranks.
    return list(groups.values())


def group_of(dims: ParallelDims, role: str, rank: int) -> list[int]:
    """The ranks of ``rank``'s group of ``role``."""
    return next(group for group in role_groups(dims, role) if rank in group)
