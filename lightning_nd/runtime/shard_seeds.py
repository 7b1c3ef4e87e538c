"""Seeds that give every shard of a tensor its own random numbers and every copy of a shard the same ones.

On CPU meshes DTensor has no distributed RNG (torch warns "DTensor random operators may not have complete support
on cpu device mesh"): every rank would draw the *same* numbers, so all shards of a weight would be copies of each
other. So each random draw is made under a seed made from what is drawn (a module, or a tensor's name) and the
identity of this rank's shard (the mesh dims that split the tensor and this rank's coordinate on them): ranks that
hold the same shard draw the same numbers, ranks that hold different shards draw different ones. That holds however
a tensor is replicated: on a Replicate mesh dim, or on dims outside its mesh (a norm weight FSDP shards over dp is
still replicated over tp), or everywhere (a plain tensor).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor


def shard_identity(tensor: torch.Tensor) -> tuple:
    """Equal on exactly the ranks that hold the same values of ``tensor``."""
    if not isinstance(tensor, DTensor):
        return ()
    mesh = tensor.device_mesh
    coordinate: Sequence[int] = mesh.get_coordinate() or []
    return tuple(
        (mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else dim, coordinate[dim])
        for dim, placement in enumerate(tensor.placements)
        if not (placement.is_replicate() or placement.is_partial())
    )


def shard_seed(base: int, what: object, identity: tuple) -> int:
    """The seed of drawing ``what`` (any repr-stable key) on the shard ``identity``."""
    digest = hashlib.sha256(repr((base, what, identity)).encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's values: a DTensor's local shard, a plain tensor's data."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor.data
