"""Turn a sharded meta-device model into real tensors, each rank allocating only its own shards.

``to_empty`` allocates the local shards, then every module's ``reset_parameters()`` fills them.
On CUDA, DTensor's offset-based RNG makes each shard draw the numbers it would hold in a
single-device init. On CPU that RNG does not exist (torch warns "DTensor random operators may not
have complete support on cpu device mesh") and every rank would draw the *same* numbers, so all
shards of a weight would be copies of each other. There, each rank draws from its own seed and
then the replicas of each shard (its Replicate mesh dims, or every rank for a plain tensor) take
the values of the first rank of their group, so replicas agree and shards differ.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

log = logging.getLogger("lightning_nd")


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(module))


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def materialize(module: nn.Module, device: torch.device, seed: int = 0) -> list[str]:
    """Allocate and initialise every meta tensor of ``module``; returns the classes left uninitialised
    (they have parameters or buffers but no ``reset_parameters``)."""
    if not has_meta(module):
        return []
    module.to_empty(device=device)
    cpu_rng = device.type == "cpu" and dist.is_initialized()
    uninitialised = set()
    with torch.random.fork_rng(devices=[], enabled=cpu_rng), warnings.catch_warnings():
        # torch's warning is about exactly the gap this function closes for CPU meshes.
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support on cpu")
        if cpu_rng:
            torch.manual_seed(seed + dist.get_rank())
        for submodule in module.modules():
            if not any(True for _ in submodule.parameters(recurse=False)) and not any(
                True for _ in submodule.buffers(recurse=False)
            ):
                continue
            reset = getattr(submodule, "reset_parameters", None)
            if callable(reset):
                reset()
            else:
                uninitialised.add(type(submodule).__name__)
    if cpu_rng:
        _agree_on_replicas(module)
    if uninitialised:
        log.warning(
            "Modules without `reset_parameters()` keep uninitialised memory after meta-device init: %s."
            " HINT: give them a `reset_parameters()` or build them outside `configure_model`.",
            ", ".join(sorted(uninitialised)),
        )
    return sorted(uninitialised)


@torch.no_grad()
def _agree_on_replicas(module: nn.Module) -> None:
    for tensor in _tensors(module):
        if isinstance(tensor, DTensor):
            local = tensor.to_local()
            for dim, placement in enumerate(tensor.placements):
                if isinstance(placement, Replicate) and tensor.device_mesh.size(dim) > 1:
                    dist.broadcast(local, group=tensor.device_mesh.get_group(dim), group_src=0)
        else:
            dist.broadcast(tensor.data, src=0)
