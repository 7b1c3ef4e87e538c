"""Gradient clipping by the true global norm, for gradients sharded over any mix of meshes.

``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails (or is wrong) when
parameters live on different meshes (FSDP-only vs FSDP x TP) or are plain replicated tensors.
Here each group of gradients that share a mesh and placements is reduced once, then the groups add.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def global_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients as if they sat unsharded on one device (same value on every rank)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else "local"
        groups.setdefault(key, []).append(grad)
    norm_type = float(norm_type)
    partial_norms = []
    for key, grads in groups.items():
        norms = torch._foreach_norm(grads, norm_type)
        group_norm = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if isinstance(group_norm, DTensor):
            group_norm = group_norm.full_tensor()
        partial_norms.append(group_norm)
    if not partial_norms:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack(partial_norms), norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient by ``max_norm / global_norm`` when the global norm exceeds ``max_norm``."""
    parameters = [p for p in parameters if p.grad is not None]
    total = global_grad_norm(parameters, norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in parameters:
        param.grad.mul_(coefficient.to(param.grad.device) if not isinstance(param.grad, DTensor) else coefficient.item())
    return total
