"""The collectives of expert parallelism, each over the ep group: the per-expert token counts every sender routes
here, the global count per expert, and the tokens' trip to their experts' ranks and back (autograd: the backward
sends the gradients the other way); and the scale of the expert gradients that trip sums over the group.

    rows = all_to_all_rows(tokens, send_splits, recv_splits, group)   # rank r gets the rows for its experts
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from lightning_nd.runtime.profiling import comm_label


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``counts[r]``: what this rank sends to rank r's experts -> ``[sender, local expert]`` received here."""
    received = torch.empty_like(counts)
    with comm_label("ep", "all_to_all"):
        dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received


def summed_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Tokens per expert over the whole ep group."""
    totals = counts.clone()
    with comm_label("ep", "all_reduce"):
        dist.all_reduce(totals, group=group)
    return totals


def all_to_all_rows(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                    group: dist.ProcessGroup) -> torch.Tensor:
    """Rows sent ``send_splits[r]`` to rank r, ``recv_splits[r]`` received from it; the gradient goes back."""
    with comm_label("ep", "all_to_all"):
        return wait_tensor(all_to_all_single_autograd(rows.contiguous(), recv_splits, send_splits, group))


class ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` in backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None
