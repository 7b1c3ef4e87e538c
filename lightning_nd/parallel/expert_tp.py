"""Expert tensor parallelism (ETP, as Megatron-Core's): each rank of a tp group holds a slice of every expert.

An experts module in the Hugging Face layout (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) is split as a
SwiGLU MLP is under tp: ``gate_up_proj`` part by part on dim 1 (rank r holds gate rows ``r*I/tp ..`` and up rows
``I + r*I/tp ..``: torch's ``_StridedShard(1, split_factor=2)``, so the DTensor still means the whole stack and
checkpoints are in the model's own order), ``down_proj`` on dim 2. The tokens routed to an expert are the same on
every tp rank (the router and its input are replicated over tp), so each rank computes its slice of the
intermediate activation and, through its slice of ``down_proj``, a partial sum of the expert's output.

- `reduce_from_tp` sums the partial outputs over tp (identity in backward) before the routing weights multiply
  them, so every tp rank holds the whole output and the router's gradient is whole, as in one process;
- `copy_to_tp` is the identity on the experts' input and sums its gradient, partial per rank, over tp;
- `check_same_routing` makes sure the tp ranks routed alike (one small all-reduce per layer and forward), so a
  model whose replicated weights differ across tp ranks stops with the fix named instead of a collective mismatch.

Pure torch: no Lightning, no planning.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_nd.runtime.profiling import comm_label

GATE_UP_PLACEMENT = _StridedShard(1, split_factor=2)
DOWN_PLACEMENT = Shard(2)


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


def check_same_routing(counts: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Every tp rank routed the same number of tokens to each expert (one small all-reduce): a split expert's
    partial outputs are summed row by row, so routing that differs (replicated router weights or inputs that differ
    across tp ranks) would mismatch the sums. Raised on every tp rank alike."""
    bounds = torch.stack([counts, -counts])
    with comm_label("tp", "all_reduce"):
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(bounds[0], -bounds[1]):
        raise RuntimeError(
            "Expert tensor parallelism: the tp ranks routed different tokens to the experts (tokens per expert from"
            f" {(-bounds[1]).tolist()} to {bounds[0].tolist()}), so the experts' partial outputs cannot be summed."
            " The router's weights or its input differ across tp ranks: a model built on each rank without a common"
            " seed does that. HINT: call `lightning.seed_everything(...)` before building the model (or build it on"
            " the meta device, which lightning_nd initialises with one seed).")


def copy_to_tp(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Identity; the gradient summed over ``group``."""
    return _CopyToTP.apply(tensor, group)


def reduce_from_tp(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ``group``; the gradient passed through."""
    return _ReduceFromTP.apply(tensor, group)


def tp_slice(name: str, weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s slice (of ``size``) of experts' ``gate_up_proj`` (``[.., 2I, H]``: ``[gate_r; up_r]``) or
    ``down_proj`` (``[.., H, I]``: its columns ``r``), of a stack or of one expert."""
    packed = name == "gate_up_proj"
    inner = weight.shape[-2] // 2 if packed else weight.shape[-1]
    if inner % size:
        raise ValueError(f"Expert tensor parallelism splits each expert's intermediate size ({inner}) over tp={size},"
                         " which does not divide it. HINT: a tp that divides the intermediate size.")
    width = inner // size
    start = rank * width
    if not packed:
        return weight[..., start:start + width]
    return torch.cat([weight[..., start:start + width, :], weight[..., inner + start:inner + start + width, :]], dim=-2)
