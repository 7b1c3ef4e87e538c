"""Packed tensor-parallel shards through DCP: a ``_StridedShard`` tensor is saved and loaded as a plain ``Shard``.

A fused weight split part by part over tp (``[gate; up]``, ``[q; k; v]``, experts' ``gate_up_proj``:
`lightning_nd.tensor_parallel.apply.linear.FusedColwiseParallel`, `lightning_nd.tensor_parallel.apply.experts`) is a
DTensor with a ``_StridedShard`` placement: rank r holds part r of each part, which is not one contiguous block of the whole
tensor. DCP describes every local shard by one offset and size (torch 2.13 gives rank 1 of
``_StridedShard(1, split_factor=2)`` over 2 ranks the offset of row I/2, where it holds rows I/2.. and 3I/2..), so
such a tensor would be written to, and read from, the wrong places. `contiguous` swaps each one for its
redistribution to the plain ``Shard`` on the same dim (one contiguous block per rank, the same whole tensor) while
DCP saves or loads; `restore` puts it back, after a load with what was read, in its own placements.

FSDP over a tp-split dim gives ``(_StridedShard(0, split_factor=tp), Shard(0))``: the split factor only records that
tp split first, each rank's rows are one block where DCP puts them, and it is left as it is (`packed`);
redistributing it would cost two all_gathers per tensor at every save and load.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

Swaps = list[tuple[Any, Any, DTensor, DTensor]]
"""(container, key, the state's own tensor, its contiguous stand-in in the container meanwhile)."""


def contiguous(state: Any) -> Swaps:
    """Put, in place in ``state`` (nested dicts and lists), the plain-``Shard`` redistribution of every
    `packed` DTensor instead of it; what was swapped, for `restore`. DCP loads non-tensor values into the
    containers it is given, so the swap is in the caller's own containers."""
    swaps: Swaps = []
    stack = [state]
    while stack:
        container = stack.pop()
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, value in list(items):
            if isinstance(value, DTensor) and packed(value):
                plain = value.redistribute(value.device_mesh, [Shard(p.dim) if isinstance(p, _StridedShard) else p
                                                               for p in value.placements])
                container[key] = plain
                swaps.append((container, key, value, plain))
            elif isinstance(value, dict | list):
                stack.append(value)
    return swaps


def packed(tensor: DTensor) -> bool:
    """Whether a ``_StridedShard`` of ``tensor`` packs parts: its split factor is not the product of the later mesh
    dims that ``Shard`` the same tensor dim (then a rank's shard is not one block of the whole)."""
    placements, sizes = tensor.placements, tensor.device_mesh.shape
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            split_later = math.prod(size for size, later in zip(sizes[mesh_dim + 1:], placements[mesh_dim + 1:])
                                    if isinstance(later, Shard) and later.dim == placement.dim)
            if placement.split_factor != split_later:
                return True
    return False


@torch.no_grad()
def restore(swaps: Swaps, loaded: bool) -> None:
    """Put each tensor back in its place; ``loaded``: first copy what was read into its stand-in into it, in its
    own placements."""
    for container, key, own, plain in swaps:
        if loaded:
            own.to_local().copy_(plain.redistribute(own.device_mesh, own.placements).to_local())
        container[key] = own
