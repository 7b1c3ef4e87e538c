"""Build the N-D `DeviceMesh` for a `ParallelDims`, with one named sub-mesh per mesh role.

The roles (``pp, dp_replicate, dp_shard, cp, tp``, ``batch``, ``fsdp``, ``loss``, ``hsdp``, and under ep
``ep`` and ``expert_dp``) are defined in `mesh/roles.py`, which gives the same groups without a process
group. Every sub-mesh is a slice of one world mesh, so ``mesh["tp"]``, ``mesh["fsdp"]`` work.

Flattening is private API in torch 2.13 (``DeviceMesh._flatten``/``_unflatten``); this is the one place
that uses it, and it keeps the flattened meshes itself (slicing them from the root is deprecated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_nd.mesh.dims import MESH_DIMS, ParallelDims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class NDMesh:
    """The world mesh plus its named sub-meshes; ``mesh["tp"]`` returns a 1-D or N-D `DeviceMesh`."""

    def __init__(self, world: DeviceMesh, named: dict[str, DeviceMesh]) -> None:
        self.world = world
        self._named = named

    @property
    def names(self) -> list[str]:
        return list(self._named)

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(name, str) and name in self._named:
            return self._named[name]
        assert self.world.mesh_dim_names is not None, "`build_mesh` names every dim of the world mesh"
        if isinstance(name, tuple) and all(part in self.world.mesh_dim_names for part in name):
            return self.world[name]
        raise KeyError(f"No sub-mesh named {name!r}. Valid names: {', '.join(self.names)}.")

    def group(self, name: str):
        """The process group of this rank along a named dim."""
        return self[name].get_group()

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's group along a named dim."""
        return self[name].mesh.flatten().tolist()

    def size(self, name: str) -> int:
        return self[name].size()

    def local_rank(self, name: str) -> int:
        """This rank's index within its group along a named dim (row-major over an N-D sub-mesh)."""
        mesh = self[name]
        coordinates = mesh.get_coordinate()
        assert coordinates is not None, "this rank is in every sub-mesh of its world"
        index = 0
        for size, coordinate in zip(mesh.shape, coordinates):
            index = index * size + coordinate
        return index


_built: dict[tuple, NDMesh] = {}
"""Meshes built in this process, by device type and shape: a later run of the same shape reuses one."""


def _alive(mesh: NDMesh, groups: object) -> bool:
    """Every group of ``mesh`` is still registered in this process's (or this thread's) world."""
    try:
        return all(group in groups for name in mesh.names for group in mesh[name].get_all_groups())  # type: ignore
    except RuntimeError:  # its names were unregistered (the groups destroyed)
        return False


def build_mesh(dims: ParallelDims, device_type: str) -> NDMesh:
    """The world mesh (needs an initialised default process group) with every named sub-mesh.

    A mesh of the same shape built earlier in this process, whose groups are all still registered (the default
    group was not destroyed since), is returned again: its groups are the same communicators, while a new set
    would stay alive beside it (nothing releases a mesh's groups, and each idle gloo group keeps a thread
    waking). So a later stage (validate after fit) and a later Trainer of the same layout cost no new groups.
    """
    from torch.distributed.distributed_c10d import _world

    key = (device_type, dims.shape, dims.ep)
    cached = _built.get(key)
    if cached is not None and _alive(cached, _world.pg_map):
        return cached
    _built[key] = _new_mesh(dims, device_type)
    return _built[key]


def _new_mesh(dims: ParallelDims, device_type: str) -> NDMesh:
    from torch.distributed.device_mesh import init_device_mesh

    shard_parts: tuple[str, ...] = ("dp_shard",)
    shape: dict[str, int | tuple[int, int]] = dict(zip(MESH_DIMS, dims.shape))
    if dims.ep > 1:
        # EP borrows the inner part of dp_shard (and all of cp): split dp_shard in two real mesh dims.
        inside = dims.dp_shard_in_ep
        shard_parts = ("dp_shard_mod_ep", "dp_shard_in_ep")
        shape = {**shape, "dp_shard": (dims.dp_shard // inside, inside)}
    world_names: list[str] = []
    world_shape: list[int] = []
    for name in MESH_DIMS:
        size = shape[name]
        sizes = size if isinstance(size, tuple) else (size,)
        world_names += shard_parts if name == "dp_shard" else (name,)
        world_shape += sizes
    world = init_device_mesh(device_type, tuple(world_shape), mesh_dim_names=tuple(world_names))

    named = {name: world[name] for name in world_names}
    flatten = {
        "batch": ("dp_replicate", *shard_parts),
        "fsdp": (*shard_parts, "cp"),
        "loss": ("dp_replicate", *shard_parts, "cp"),
    }
    if dims.ep > 1:
        flatten = {"dp_shard": shard_parts, **flatten, "ep": ("dp_shard_in_ep", "cp"),
                   "expert_dp": ("dp_replicate", "dp_shard_mod_ep")}
    for flat_name, parts in flatten.items():
        named[flat_name] = world[parts]._flatten(flat_name)
    if dims.ep > 1 and dims.tp > 1:  # experts split both ways: one 2-D (ep, tp) mesh for their DTensors
        named["ep_tp"] = world[("dp_shard_in_ep", "cp", "tp")]._flatten("ep_tp")._unflatten(
            0, (dims.ep, dims.tp), ("ep", "tp"))
    # HSDP wants one 2-D (replicate, shard) mesh.
    named["hsdp"] = named["loss"]._unflatten(0, (dims.dp_replicate, dims.dp_shard * dims.cp), ("dp_replicate", "fsdp"))
    return NDMesh(world, named)
