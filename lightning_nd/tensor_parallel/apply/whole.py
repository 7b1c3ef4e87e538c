"""Modules every tp rank holds whole, or whose own per-head vectors only are split: Hugging Face's
``replicated_with_grad_allreduce`` and ``mla_kv_a_proj`` (``transformers/distributed/tensor_parallel.py``), with the
same meaning; ``down_projection`` (a whole layer reading an attention's shared input for a colwise layer, MLA's
``q_a_proj``); per-head parameters; and the sequence-parallel norm that slices a whole input.
"""

from __future__ import annotations

from functools import partial
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from lightning_nd.tensor_parallel.apply.forward_views import restore_parameters, swap_parameters
from lightning_nd.tensor_parallel.apply.linear import distribute_parameters


class ReplicatedPartialGrad(ParallelStyle):
    """Hugging Face's ``replicated_with_grad_allreduce``: parameters whole on every tp rank, but each rank's
    gradient covers only its own heads (Qwen3's per-head ``q_norm``/``k_norm`` between a colwise and a rowwise
    layer), so the gradients are summed over tp.

    The parameters are Replicate DTensors; the forward runs on local views whose gradient is declared Partial,
    so the sum happens where DTensor resolves Partial (FSDP's reduction, or the optimizer), as for the
    sequence-parallel norms. A plain ``replicate`` here would leave each rank with its own heads' gradient."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_parameters(module, device_mesh, lambda param: Replicate())
        module.register_forward_pre_hook(partial(_use_local_parameters, Partial()))
        module.register_forward_hook(restore_parameters)
        return module


class PerHeadParameters(ParallelStyle):
    """Hugging Face's ``local_params`` with its parameters declared ``colwise``: a module's own parameters with one
    entry per head (attention sinks, Beam's ``gate_bias``) are split on their first dim, as its colwise projections
    split the heads, and its forward runs on the local shards: each rank's gradient is its heads' part."""

    def __init__(self, vectors_only: bool = False) -> None:
        super().__init__()
        self.vectors_only = vectors_only  # `per_channel_vectors`: RWKV's [1, 1, H] input-mixing weights stay whole

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            if param.ndim == 1 or not self.vectors_only:
                module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)]),
                                                             requires_grad=param.requires_grad))
        module.register_forward_pre_hook(partial(_use_local_parameters, Shard(0)))
        module.register_forward_hook(restore_parameters)
        return module


def _use_local_parameters(grad_placement, module: nn.Module, args: tuple) -> None:
    swap_parameters(module, {name: cast(DTensor, param).to_local(grad_placements=[grad_placement])
                             for name, param in module._parameters.items() if isinstance(param, DTensor)})


class ShardingSequenceParallel(SequenceParallel):
    """`SequenceParallel` that slices a plain (full, replicated) input instead of assuming it is a shard.

    torch's version takes a plain tensor to be the local shard already; a norm that sees the full
    residual (one before the first block, say) would then be silently wrong.
    """

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        value = inputs[0]
        if not isinstance(value, DTensor):
            value = DTensor.from_local(value, device_mesh, [Replicate()], run_check=False)
        if value.placements != tuple(sequence_sharding):
            value = value.redistribute(placements=sequence_sharding)
        return value


class WholeOnSharedInput(ParallelStyle):
    """A layer kept whole on every tp rank that reads its attention's shared input (a Replicate DTensor, see
    `apply_tp`) and whose output a colwise layer reads (MLA's ``q_a_proj``, and ``kv_a_proj_with_mqa``): it runs
    on the local input, and the gradient it hands back is whole on every rank, since the colwise layer after it
    sums its input gradient over tp.

    ``rope_dim``: Hugging Face's ``mla_kv_a_proj``. The last ``rope_dim`` output features (MLA's shared rotary key)
    go straight to every head, so each rank's gradient of them covers its own heads only; it is summed over tp
    (an all-reduce in backward, none in forward)."""

    def __init__(self, rope_dim: int = 0) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_local_input)
        if self.rope_dim:
            module.register_forward_hook(partial(_sum_rope_gradient, self.rope_dim, device_mesh))
        return module


def _local_input(module: nn.Module, args: tuple) -> tuple:
    value, *rest = args
    if isinstance(value, DTensor):
        value = value.redistribute(placements=[Replicate()]).to_local(grad_placements=[Replicate()])
    return (value, *rest)


def _sum_rope_gradient(rope_dim: int, mesh: DeviceMesh, module: nn.Module, args: tuple, output):
    latent, rope = output.split([output.shape[-1] - rope_dim, rope_dim], dim=-1)
    summed = DTensor.from_local(rope, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
    return torch.cat([latent, summed], dim=-1)
