"""Gradient clipping by the true global norm, for gradients sharded over any mix of meshes.

``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails when parameters live on
different meshes (FSDP-only vs FSDP x TP) and costs one collective per mesh dim otherwise. Here
each rank sums ``|g|^p`` over its local shards, weighting each by how many ranks hold the same
shard, and one all-reduce over all ranks gives the norm of the unsharded gradients. A weight tied between
the first and the last pipeline stage has a copy on each (`pipeline_parallel/tied.py`), with equal
gradients: it counts once, as the first stage's (Megatron-LM skips the shared copy in the same way).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

PIPELINE_COPY = "pipeline_copy_of"
"""Set on the last stage's copy of a tied weight: the name of the weight it copies."""
HELD_BY_ONE_EP_RANK_OF = "held_by_one_ep_rank_of"
"""Set on a parameter of an expert kept in a list (`lightning_nd.expert_parallel.lists`): the ep size. One rank of each
ep group holds it and the others hold other experts, which its gradient's placements do not say."""


def _copies(param: torch.Tensor, world_size: int) -> int:
    """How many ranks hold the same values as this rank's local piece of ``param``'s gradient."""
    grad, ep = param.grad, getattr(param, HELD_BY_ONE_EP_RANK_OF, 1)
    if not isinstance(grad, DTensor):
        return world_size // ep
    # Anything neither replicated nor partial splits the tensor (Shard, and FSDP x TP's _StridedShard).
    shards = math.prod(
        grad.device_mesh.size(d) for d, p in enumerate(grad.placements) if not (p.is_replicate() or p.is_partial())
    )
    return world_size // shards // ep


def align_grads_to_params(parameters: Iterable[torch.Tensor]) -> None:
    """Give every DTensor gradient its parameter's placements.

    A replicated weight fed by sharded activations (a norm under sequence parallel) ends backward
    with a Partial gradient whose local values are only summands; a vocabulary-sharded embedding
    ends it with a full, replicated gradient on every rank (torch's embedding backward rule). The
    first needs its reduction, the second only a local slice that frees the rest.
    """
    for param in parameters:
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def _collective_device(tensors: list[torch.Tensor]) -> torch.device:
    """Where the all-reduce can run: NCCL needs CUDA even when the gradients sit in host memory (CPU offload)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return tensors[0].device if tensors else torch.device("cpu")


def global_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0, pp: int = 1) -> torch.Tensor:
    """The norm of all gradients as if they sat unsharded on one device (the same value on every rank).

    Gradients must hold no Partial placement (see `align_grads_to_params`). Under ``pp`` pipeline
    stages every parameter lives on the ranks of one stage only: 1/pp of the world (a tied weight's copy on
    the last stage is left out).
    """
    params = [p for p in parameters if p.grad is not None and not hasattr(p, PIPELINE_COPY)]
    grads = [cast(torch.Tensor, p.grad) for p in params]
    norm_type = float(norm_type)
    distributed = dist.is_initialized()
    world_size = (dist.get_world_size() if distributed else 1) // pp
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = _collective_device(locals_)
    if math.isinf(norm_type):
        maxima = [g.detach().abs().max().float().to(device) for g in locals_ if g.numel()]
        total = torch.stack(maxima).max() if maxima else torch.zeros((), device=device)
        if distributed:
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return total
    total = torch.zeros((), device=device, dtype=torch.float32)
    for param, local in zip(params, locals_):
        if local.numel():
            power_sum = torch.linalg.vector_norm(local.detach(), norm_type, dtype=torch.float32).pow(norm_type)
            total += power_sum.to(device) / _copies(param, world_size)
    if distributed:
        dist.all_reduce(total)
    return total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, pp: int = 1
) -> torch.Tensor:
    """Scale every gradient by ``max_norm / global_norm`` when the global norm exceeds ``max_norm``."""
    parameters = [p for p in parameters if p.grad is not None]
    align_grads_to_params(parameters)
    total = global_grad_norm(parameters, norm_type, pp)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in parameters:
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        assert grad is not None, "only parameters with a gradient are kept"
        grad.mul_(coefficient.to(grad.device, grad.dtype))
    return total
