"""The autograd collectives of tensor parallelism, each a forward and the backward it implies over the tp group:

    copy_to_tp(x, group)       # identity; gradient summed over tp
    reduce_from_tp(x, group)   # sum over tp; gradient passed through
    gather_sequence(x)         # sequence shards -> whole sequence; gradient reduce-scattered back to shards
    gather_features(x, mesh)   # each rank's last-dim features side by side; gradient reduce-scattered back

Pure torch: no Lightning, no planning.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_single, reduce_scatter_single, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_nd.runtime.profiling import comm_label


def _all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    summed = tensor.contiguous().clone()
    with comm_label("tp", "all_reduce"):
        dist.all_reduce(summed, group=group)
    return summed


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return _all_reduce(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Identity; the gradient summed over ``group``."""
    return _CopyToTP.apply(tensor, group)


def reduce_from_tp(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ``group``; the gradient passed through."""
    return _ReduceFromTP.apply(tensor, group)


class _GatherSequence(torch.autograd.Function):
    """Sequence shards -> the full sequence (all-gather); in backward the projections' Partial input
    gradients go straight back to shards with one reduce-scatter (a whole gradient, from layers kept whole on
    the shared input, is sliced). DTensor's own redistribute
    all-reduced them first (measured: 1.8x the minimum bytes under SP)."""

    @staticmethod
    def forward(ctx, value: DTensor) -> DTensor:
        ctx.mesh, ctx.dim = value.device_mesh, cast(Shard, value.placements[0]).dim  # `_to_replicate` checked it
        full = wait_tensor(all_gather_single(value.to_local().contiguous(), gather_dim=ctx.dim, group=ctx.mesh))
        return DTensor.from_local(full, ctx.mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad: DTensor) -> DTensor:
        if isinstance(grad, DTensor) and grad.placements[0].is_replicate():  # whole on every rank: a slice
            return grad.redistribute(placements=[Shard(ctx.dim)])
        local = grad.to_local() if isinstance(grad, DTensor) else grad  # Partial: unreduced summands
        shard = wait_tensor(reduce_scatter_single(local.contiguous(), "sum", scatter_dim=ctx.dim, group=ctx.mesh))
        return DTensor.from_local(shard, ctx.mesh, [Shard(ctx.dim)], run_check=False)


def gather_sequence(value: object) -> object:
    """A sequence-sharded DTensor on a 1-D tp mesh made whole (`_GatherSequence`); anything else as it is."""
    if isinstance(value, DTensor) and value.device_mesh.ndim == 1 and isinstance(value.placements[0], Shard):
        return _GatherSequence.apply(value)
    return value


class _GatherFeatures(torch.autograd.Function):
    """Every tp rank's features, rank by rank on the last dim (all-gather); each rank uses its own selection of
    them, so in backward the gradients of a rank's features are summed over tp and handed back (reduce-scatter)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh, ctx.dim = mesh, tensor.ndim - 1
        return wait_tensor(all_gather_single(tensor.contiguous(), gather_dim=ctx.dim, group=mesh))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return wait_tensor(reduce_scatter_single(grad.contiguous(), "sum", scatter_dim=ctx.dim, group=ctx.mesh)), None


def gather_features(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``tensor``'s last dim from every rank of the 1-D ``mesh``, concatenated in rank order (`_GatherFeatures`)."""
    return _GatherFeatures.apply(tensor, mesh)
