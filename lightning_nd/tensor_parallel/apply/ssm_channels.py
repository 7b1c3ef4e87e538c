"""Selective state-space mixers (Mamba's, Falcon-Mamba's, Jamba's) split by channels over tp.

Every channel of the inner width I is computed on its own: ``in_proj`` (H -> [x; z], 2 x I) gives each channel its
input and gate, the depthwise ``conv1d`` and the selective scan (``A_log``, ``D``, ``dt_proj``'s rows) run channel
by channel, and ``out_proj`` (I -> H) brings them back. So a tp rank holds I / tp channels: ``in_proj`` part by part
(``packed_colwise``), ``out_proj`` rowwise, the conv, ``dt_proj``, ``A_log`` and ``D`` split on their channel dim.
The one layer that mixes channels, ``x_proj`` (I -> dt_rank + 2 x state), sums its partial outputs over tp and every
rank uses all of them on its own channels (`RowwiseSharedOutput`, Megatron's Mamba layer does the same).

The mixer reads ``conv1d.weight`` and ``dt_proj.weight`` directly rather than calling those modules, so their
shards are swapped in for the mixer's whole forward (`ChannelMixer`), as the mixer's own ``A_log`` and ``D``.
Pure torch: no Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_nd.tensor_parallel.apply.forward_views import restore_parameters, swap_parameters


class ChannelMixer(ParallelStyle):
    """The mixer's own parameters and those of its ``children`` split on dim 0 (the channels), used as local shards
    during the mixer's forward; each rank's gradient is its channels' part."""

    def __init__(self, children: Sequence[str]) -> None:
        super().__init__()
        self.children = tuple(children)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        owners = [module, *(module.get_submodule(child) for child in self.children)]
        for owner in owners:
            for name, param in list(owner.named_parameters(recurse=False)):
                owner.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)]),
                                                            requires_grad=param.requires_grad))
        module.register_forward_pre_hook(partial(_use_local_channels, owners))
        module.register_forward_hook(partial(_restore_channels, owners))
        return module


def _use_local_channels(owners: list[nn.Module], module: nn.Module, args: tuple) -> None:
    for owner in owners:
        swap_parameters(owner, {name: cast(DTensor, param).to_local(grad_placements=[Shard(0)])
                                for name, param in owner._parameters.items() if isinstance(param, DTensor)})


def _restore_channels(owners: list[nn.Module], module: nn.Module, args: tuple, output: object) -> None:
    for owner in owners:
        restore_parameters(owner)
