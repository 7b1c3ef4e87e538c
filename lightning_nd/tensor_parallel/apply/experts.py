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
- `TransposedExpertsParallel` splits Llama 4's experts (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H], every
  token through every expert, pre-scaled by its router score) the same way, on dims 2 and 1, and runs the module's
  own forward on the local slices between `copy_to_tp` and `reduce_from_tp`;
- `check_same_routing` makes sure the tp ranks routed alike (one small all-reduce per layer and forward), so a
  model whose replicated weights differ across tp ranks stops with the fix named instead of a collective mismatch.

Pure torch: no Lightning, no planning.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_nd.runtime.profiling import comm_label
from lightning_nd.tensor_parallel.apply.forward_views import restore_parameters, swap_parameters
from lightning_nd.tensor_parallel.communication import copy_to_tp, reduce_from_tp

GATE_UP_PLACEMENT = _StridedShard(1, split_factor=2)
DOWN_PLACEMENT = Shard(2)


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


TRANSPOSED_PLACEMENTS = {"gate_up_proj": _StridedShard(2, split_factor=2), "down_proj": Shard(1)}


class TransposedExpertsParallel(ParallelStyle):
    """Expert tensor parallelism for transposed stacks that see every token (Llama 4's ``Llama4TextExperts``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, placement in TRANSPOSED_PLACEMENTS.items():
            param = module.get_parameter(name)
            dist_param = distribute_tensor(param, device_mesh, [placement])
            module.register_parameter(name, nn.Parameter(dist_param, requires_grad=param.requires_grad))
        group = device_mesh.get_group()
        module.register_forward_pre_hook(lambda mod, args: _local_stacks(mod, args, group))
        module.register_forward_hook(lambda mod, args, output: _whole_output(mod, output, group))
        return module


def _local_stacks(module: nn.Module, args: tuple, group: dist.ProcessGroup) -> tuple:
    """The module's forward runs on its local slices (their gradients go to the DTensors' shards)."""
    swap_parameters(module, {name: cast(DTensor, param).to_local() for name, param in module._parameters.items()
                             if name in TRANSPOSED_PLACEMENTS and isinstance(param, DTensor)})
    first, *rest = args
    return (copy_to_tp(first, group), *rest)


def _whole_output(module: nn.Module, output: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    restore_parameters(module)
    return reduce_from_tp(output, group)
