"""Tensors a module split by heads gets from outside, cut to the rank's heads or features.

A module split by heads computes on its rank's heads only, but a model may compute per-head or per-feature tensors
outside it and pass them in: Bloom's ALiBi bias (``[batch * heads, 1, keys]``), a ``[batch, heads, queries, keys]``
bias, NeoMME's value embeddings (``[batch, seq, kv_heads * head_dim]``, added to the output of ``v_proj``). Each is
cut to the rank's slice before the module runs. A learned one (CPM-Ant's position bias, NeoMME's value embedding)
gets a gradient for the rank's slice only, which is summed over tp.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TypeGuard

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate


def local_head_inputs(heads: int, features: Collection[int], tp_mesh: DeviceMesh) -> Callable:
    """Pre-hook of a module split by heads (``heads``: its head count, 0 when it has none). Cut: floating tensors
    after the first argument of 3 or more dims whose first dim is batch x heads or whose second (of 4) is the head
    count, and those shaped as the first argument but for a last dim that is one of ``features``, the full output
    widths of its colwise layers that are not their input width (a tensor of the input's width is whole; one whose
    last two dims are equal, a mask, is left alone)."""
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()

    def summed(value: torch.Tensor) -> torch.Tensor:
        if not value.requires_grad:
            return value
        return DTensor.from_local(value, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])

    def cut(shape: torch.Size, value: object) -> object:
        if not is_plain_float(value) or value.dim() < 3:
            return value
        local, batch = heads // tp, shape[0]
        if heads and value.shape[0] == batch * heads:
            per_head = summed(value).reshape(batch, heads, *value.shape[1:])[:, rank * local:(rank + 1) * local]
            return per_head.reshape(batch * local, *value.shape[1:])
        if heads and value.dim() == 4 and value.shape[:2] == (batch, heads):
            return summed(value)[:, rank * local:(rank + 1) * local]
        if value.shape[-1] in features and value.shape[:-1] == shape[:-1] and value.shape[-1] != value.shape[-2]:
            width = value.shape[-1] // tp
            return summed(value)[..., rank * width:(rank + 1) * width]
        return value

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        first = args[0] if args else next(iter(kwargs.values()), None)
        if not isinstance(first, torch.Tensor) or first.dim() < 2:
            return args, kwargs
        return ((args[0], *(cut(first.shape, a) for a in args[1:])) if args else args,
                {key: value if value is first else cut(first.shape, value) for key, value in kwargs.items()})

    return hook


def is_plain_float(value: object) -> TypeGuard[torch.Tensor]:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.is_floating_point()
