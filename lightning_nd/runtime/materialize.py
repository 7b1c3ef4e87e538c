"""Turn a sharded meta-device model into real tensors, each rank allocating only its own shards.

``to_empty`` allocates the local shards, then every module's ``reset_parameters()`` fills them.
On CPU meshes DTensor has no distributed RNG (torch warns "DTensor random operators may not have
complete support on cpu device mesh"): every rank would draw the *same* numbers, so all shards of
a weight would be copies of each other. So each tensor is drawn under a seed made from the identity
of its shard (module, mesh dims and this rank's coordinate on the dims that split it): ranks that
hold the same shard draw the same numbers, ranks that hold different shards draw different ones.
That holds however a tensor is replicated: on a Replicate mesh dim, or on dims outside its mesh
(a norm weight FSDP shards over dp is still replicated over tp), or everywhere (a plain tensor).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_nd.runtime.probe import check_initialisable, own_tensors


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in own_tensors(module))


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


def _seed(base: int, module_index: int, identity: tuple) -> int:
    digest = hashlib.sha256(repr((base, module_index, identity)).encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63)


def materialize(module: nn.Module, device: torch.device, seed: int = 0) -> None:
    """Allocate and initialise every meta tensor of ``module``, each rank only its shards.

    A tensor shared by several modules (a tied head) is initialised by the first module that owns
    it, as when the tie is made after construction (``head.weight = embedding.weight``).
    """
    if not has_meta(module):
        return
    check_initialisable(module)
    module.to_empty(device=device)
    cuda_devices = [device.index or 0] if device.type == "cuda" else []
    done: set[int] = set()
    with torch.no_grad(), torch.random.fork_rng(devices=cuda_devices), warnings.catch_warnings():
        # torch's warning is about exactly the gap the per-shard seeds close on CPU meshes.
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support on cpu")
        for index, submodule in enumerate(module.modules()):
            own = list(own_tensors(submodule, recurse=False))
            if not own or not callable(getattr(submodule, "reset_parameters", None)):
                continue
            earlier = {id(t): _local(t).clone() for t in own if id(t) in done}
            _reset_per_identity(submodule, own, seed, index)
            for tensor in own:
                if id(tensor) in earlier:
                    _local(tensor).copy_(earlier[id(tensor)])
            done.update(id(t) for t in own)


@torch.no_grad()
def _reset_per_identity(submodule: nn.Module, own: list[torch.Tensor], seed: int, index: int) -> None:
    """One ``reset_parameters()`` per distinct shard identity among the module's tensors, each kept
    only for the tensors of that identity (usually one pass; two for e.g. a rowwise weight + bias)."""
    identities = {id(t): shard_identity(t) for t in own}
    if len(set(identities.values())) == 1:
        torch.manual_seed(_seed(seed, index, next(iter(identities.values()))))
        # `materialize` checked that the module has a callable `reset_parameters`, which `nn.Module` does not declare.
        cast("Callable[[], None]", submodule.reset_parameters)()
        return
    kept: dict[int, torch.Tensor] = {}
    for identity in dict.fromkeys(identities.values()):
        torch.manual_seed(_seed(seed, index, identity))
        cast("Callable[[], None]", submodule.reset_parameters)()
        for tensor in own:
            if identities[id(tensor)] == identity:
                kept[id(tensor)] = _local(tensor).clone()
    for tensor in own:
        _local(tensor).copy_(kept[id(tensor)])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor.data
