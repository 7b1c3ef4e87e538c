"""A fused ``[q; k; v]`` sized by head counts, split by heads: the ``packed_heads`` and ``rowwise_packed_heads`` styles
(planned by `lightning_nd/tensor_parallel/infer/fused_heads.py`).

The fused weight stays one parameter whose DTensor means the model's own tensor: its full tensor, state dict and
checkpoints are in the model's order. DTensor places rows on ranks as contiguous blocks (``Shard``) or as the same
block of each of some equal parts (``_StridedShard``); with ``g`` key/value heads for ``n`` query heads
(``a = n / g`` > 1) neither gives rank r both the query heads ``[r n/tp, (r+1) n/tp)`` and the key/value heads those
read. So the weight is split as ``a + 2`` equal parts of ``g * head_dim`` rows (``a`` of queries, the keys, the
values), each part on its own (`FusedColwiseParallel`): rank r holds the query heads ``j g + r g/tp + t``
(``j < a``, ``t < g/tp``) and the key/value heads ``r g/tp + t``. Its query heads read other ranks' keys and
values: after the projection the keys and values are gathered over tp (one all-gather of ``2 g/tp * head_dim``
features from each rank, reduce-scattered in backward) and repeated for each local query head, so the module runs
with ``n/tp`` query heads and as many key/value heads (`localize_head_counts`). With ``a = 1`` (multi-head) each
rank already holds its heads' keys and values and nothing is gathered. The output projection holds the same query
heads' inputs (``_StridedShard(1, a)``) and sums its partial outputs over tp as a rowwise layer does.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_nd.tensor_parallel.apply.linear import Conv1DRowwiseParallel, FusedColwiseParallel, distribute_parameters
from lightning_nd.tensor_parallel.communication import gather_features
from lightning_nd.tensor_parallel.infer.fused_heads import HeadLayout


class PackedHeadsColwise(FusedColwiseParallel):
    """The fused ``[q; k; v]`` layer: its rows part by part (see the module docstring), its output the rank's query
    heads followed by the keys and the values of each of them."""

    def __init__(self, *, layout: HeadLayout, **kwargs) -> None:
        super().__init__(parts=layout.heads // layout.groups + 2, **kwargs)
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        if self.layout.heads != self.layout.groups:
            module.register_forward_hook(partial(_keys_values_per_head, self.layout, device_mesh))
        return module


def _keys_values_per_head(layout: HeadLayout, mesh: DeviceMesh, module: nn.Module, args: tuple,
                          output: torch.Tensor) -> torch.Tensor:
    tp, rank = mesh.size(), mesh.get_local_rank()
    local, per_group = layout.groups // tp, layout.heads // layout.groups
    query, keys_values = output.split([per_group * local * layout.head_dim, 2 * local * layout.head_dim], dim=-1)
    gathered = gather_features(keys_values, mesh).unflatten(-1, (tp, 2, local, layout.head_dim))
    whole = gathered.transpose(-4, -3).flatten(-3, -2)  # [..., keys / values, every key/value head, head_dim]
    groups = [(part * layout.groups + rank * local + head) // per_group for part in range(per_group)
              for head in range(local)]
    per_head = whole.index_select(-2, torch.tensor(groups, device=output.device))
    return torch.cat([query, per_head.flatten(-3)], dim=-1)


class PackedHeadsRowwise(Conv1DRowwiseParallel):
    """The output projection of a ``packed_heads`` layer: the inputs of the rank's query heads (a ``_StridedShard``
    over ``a`` parts; a plain ``Shard`` for ``a = 1``), its bias whole."""

    def __init__(self, *, layout: HeadLayout, **kwargs) -> None:
        super().__init__(**kwargs)
        self.per_group = layout.heads // layout.groups

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.per_group == 1:
            return super()._apply(module, device_mesh)
        placement = _StridedShard(1, split_factor=self.per_group)
        return distribute_module(
            module, device_mesh,
            lambda name, mod, mesh: distribute_parameters(mod, mesh,
                                                          lambda param: placement if param == "weight" else Replicate()),
            cast(Any, partial(_strided_heads_input, self.per_group)),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


def _strided_heads_input(per_group: int, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> DTensor:
    """The local heads' features, laid out as the weight's inputs."""
    local = inputs[0]
    return DTensor.from_local(local, mesh, [_StridedShard(local.ndim - 1, split_factor=per_group)], run_check=False)


def localize_head_counts(module: nn.Module, layout: HeadLayout, tp: int) -> None:
    """The module reshapes with ``heads / tp`` query heads and as many key/value heads (they arrive one per query
    head). Counts kept in the module's ``config`` are set on a copy of it: the model's modules share one config."""
    holder = module
    if layout.holder:
        holder = copy.copy(getattr(module, layout.holder))
        setattr(module, layout.holder, holder)
    for attr in layout.attrs:
        setattr(holder, attr, layout.heads // tp)
