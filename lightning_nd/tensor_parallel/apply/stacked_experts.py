"""Experts stored as one ``[E, out, in]`` weight and called as a layer (JetMoE's ``ParallelExperts``: ``forward(inputs,
expert_size)`` runs ``F.linear`` per expert), split over tp as linear layers are.

- `StackedColwise`: every expert's output rows split (dim 1; ``parts`` > 1: each of that many equal parts on its
  own, JetMoE's ``[gate; up]``), its input passed through `copy_to_tp` (its gradient, a part per rank, summed);
- `StackedRowwise`: every expert's input columns split (dim 2), its partial outputs summed over tp by
  `reduce_from_tp` before the module's gates multiply them, so the router's gradient is whole, as in one process.

Each forward runs on the local slices (swapped in for the call, the DTensors put back after). Pure torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_nd.tensor_parallel.apply.forward_views import restore_parameters, swap_parameters
from lightning_nd.tensor_parallel.communication import copy_to_tp, reduce_from_tp


class _Stacked(ParallelStyle):
    placement: Placement

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        weight = cast(nn.Parameter, module.weight)
        module.weight = nn.Parameter(distribute_tensor(weight, device_mesh, [self.placement]),
                                     requires_grad=weight.requires_grad)
        module.register_forward_pre_hook(partial(self._before, device_mesh))
        module.register_forward_hook(partial(self._after, device_mesh))
        return module

    def _before(self, mesh: DeviceMesh, module: nn.Module, args: tuple) -> tuple:
        swap_parameters(module, {"weight": cast(DTensor, module.weight).to_local(grad_placements=[self.placement])})
        return args

    def _after(self, mesh: DeviceMesh, module: nn.Module, args: tuple, output: object) -> object:
        restore_parameters(module)
        return output


class StackedColwise(_Stacked):
    def __init__(self, parts: int = 1) -> None:
        super().__init__()
        self.placement = Shard(1) if parts == 1 else _StridedShard(1, split_factor=parts)

    def _before(self, mesh: DeviceMesh, module: nn.Module, args: tuple) -> tuple:
        super()._before(mesh, module, args)
        return (copy_to_tp(args[0], mesh.get_group()), *args[1:])


class StackedRowwise(_Stacked):
    placement = Shard(2)

    def _after(self, mesh: DeviceMesh, module: nn.Module, args: tuple, output: object) -> object:
        restore_parameters(module)
        return reduce_from_tp(cast(torch.Tensor, output), mesh.get_group())


def divide_stacked_widths(model: nn.Module, names: Sequence[str], tp: int, attrs: Sequence[str]) -> None:
    """The owner of each ``stacked_colwise`` layer of ``names`` builds a buffer of that layer's output width (JetMoE's
    MoA: its queries, ``hidden_size``): those of its ``attrs`` equal to the width become the rank's share."""
    for name in names:
        owner = model.get_submodule(name.rpartition(".")[0])
        width = cast(torch.Tensor, model.get_submodule(name).weight).shape[1]
        for attr in attrs:
            if getattr(owner, attr, None) == width:
                setattr(owner, attr, width // tp)
