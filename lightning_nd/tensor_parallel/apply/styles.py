"""Style names -> torch `ParallelStyle`s: ``style_for(name, sequence_parallel, loss_parallel, input_shared)``.

Beyond torch's colwise/rowwise: GPT-2's ``Conv1D`` (a linear layer whose weight is stored ``[in, out]``),
fused weights of equal parts split part by part (``[gate; up]``, GPT-2's ``[q; k; v]``), and the
Hugging Face styles ``colwise_rep``, ``rowwise_split_input``, ``replicated_with_grad_allreduce`` and
``mla_kv_a_proj`` (``transformers/distributed/tensor_parallel.py``), with the same meaning, and
``down_projection``: a whole layer that reads an attention's shared input for a colwise layer (MLA's ``q_a_proj``).
"""

from __future__ import annotations

from functools import partial
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_nd.model.structure import is_conv1d
from lightning_nd.tensor_parallel.apply.attention import MultiheadAttentionParallel, packed_bias_slice
from lightning_nd.tensor_parallel.apply.experts import TransposedExpertsParallel
from lightning_nd.tensor_parallel.apply.forward_views import restore_parameters, swap_parameters
from lightning_nd.tensor_parallel.apply.stacked_experts import StackedColwise, StackedRowwise
from lightning_nd.tensor_parallel.communication import reduce_from_tp
from lightning_nd.tensor_parallel.infer.checks import PACKED_PARTS

SEQUENCE_DIM = 1


def _distribute(module: nn.Module, device_mesh: DeviceMesh, placement_of) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, device_mesh, [placement_of(param_name)])
        module.register_parameter(param_name, nn.Parameter(dist, requires_grad=param.requires_grad))


class FusedColwiseParallel(ColwiseParallel):
    """Colwise for ``nn.Linear`` and ``Conv1D``; with ``parts`` > 1, for a weight fused from that many equal parts.

    A fused ``[gate; up]`` (or ``[q; k; v]``) split by plain ``Shard`` would give rank 0 all of gate and rank 1
    all of up. ``_StridedShard(dim, parts)`` splits each part on its own, and the DTensor still means the
    original weight: its full tensor, state dict and checkpoints are in the model's own order. The output
    stays in that layout, which locally is ``[x @ gate_r, x @ up_r]``: what the module's ``chunk`` or
    ``split(split_size)`` expects (``split_size`` divided by tp, see `apply_tp`).

    A fused layer's bias (GPT-2's ``c_attn``) is held whole on every tp rank (a Replicate DTensor): FSDP2 shards
    a 1-D parameter on its only dim, and over a part-by-part tp split that gives a 2-D layout whose full tensor
    is read back in the wrong order. Each forward runs on the rank's parts of it (`_use_packed_bias`), and its
    gradient, which covers those parts only, is summed over tp (declared Partial, as `ReplicatedPartialGrad`).
    """

    def __init__(self, *, parts: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        out_dim = 1 if is_conv1d(module) else 0
        split = lambda dim: Shard(dim) if self.parts == 1 else _StridedShard(dim, split_factor=self.parts)  # noqa: E731
        packed_bias = Replicate() if self.parts > 1 else split(0)
        _distribute(module, device_mesh, lambda param: split(out_dim) if param == "weight" else packed_bias)

    def _prepare_output_fn(self, output_layouts, use_local_output, mod, outputs, device_mesh):
        if self.parts > 1:  # keep the part-by-part layout (see the class docstring)
            return outputs.to_local() if use_local_output else outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module) and self.parts == 1:
            return super()._apply(module, device_mesh)
        distribute_module(
            module, device_mesh, self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )
        if self.parts > 1 and isinstance(getattr(module, "bias", None), DTensor):
            module.register_forward_pre_hook(partial(_use_packed_bias, self.parts, device_mesh))
            module.register_forward_hook(restore_parameters)
        return module


def _use_packed_bias(parts: int, mesh: DeviceMesh, module: nn.Module, args: tuple) -> None:
    """Swap a fused layer's whole bias for the rank's slice of each part, laid out as its weight's output."""
    local = packed_bias_slice(cast(DTensor, module._parameters["bias"]), parts, mesh)
    swap_parameters(module, {"bias": DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=parts)],
                                                        run_check=False)})


class Conv1DRowwiseParallel(RowwiseParallel):
    """Rowwise for ``nn.Linear`` and ``Conv1D`` (weight ``[in, out]``: split on dim 0, bias whole).

    A partial-sum output returned as a local tensor is summed by `reduce_from_tp`, which gives a tensor of its own:
    DTensor's ``to_local`` returns a view made inside an autograd Function, which the module's next in-place op
    (Llama 4's ``out.add_(routed_out)``) may not modify."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if use_local_output and outputs.placements[0].is_partial() and output_layouts[0].is_replicate():
            return reduce_from_tp(outputs.to_local(grad_placements=[Replicate()]), device_mesh.get_group())
        return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh,
            lambda name, mod, mesh: _distribute(mod, mesh, lambda param: Shard(0) if param == "weight" else Replicate()),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class RowwiseSharedOutput(Conv1DRowwiseParallel):
    """A rowwise layer inside a split module whose summed output every rank uses on its own heads or channels (a
    state-space mixer's ``x_proj``): each rank's gradient of that output covers its own use only, so it is declared
    a part, summed over tp."""

    def __init__(self) -> None:
        super().__init__(output_layouts=Replicate(), use_local_output=False)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])


class PerHeadRowwiseParallel(RowwiseSharedOutput):
    """A layer with one output per head that reads the split heads' features (Doge's ``dt_proj``: one dynamic-mask
    weight per key/value head, from every head's values): `RowwiseSharedOutput`, cut to the rank's heads."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        whole = RowwiseSharedOutput._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        width, rank = whole.shape[-1] // device_mesh.size(), device_mesh.get_local_rank()
        return whole[..., rank * width:(rank + 1) * width]


class EmbeddingRowwiseParallel(RowwiseParallel):
    """torch's vocabulary split of an embedding, its summed lookup returned as a tensor of its own (one copy of the
    embeddings per forward): DTensor's ``to_local`` gives a view made inside an autograd Function, which a model's
    next in-place op (GIT's ``embeddings += position_embeddings``) may not modify. The sum itself stays DTensor's,
    whose masked partial zeroes the rows other ranks hold."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        output = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return output.clone() if use_local_output else output


class ReplicatedPartialGrad(ParallelStyle):
    """Hugging Face's ``replicated_with_grad_allreduce``: parameters whole on every tp rank, but each rank's
    gradient covers only its own heads (Qwen3's per-head ``q_norm``/``k_norm`` between a colwise and a rowwise
    layer), so the gradients are summed over tp.

    The parameters are Replicate DTensors; the forward runs on local views whose gradient is declared Partial,
    so the sum happens where DTensor resolves Partial (FSDP's reduction, or the optimizer), as for the
    sequence-parallel norms. A plain ``replicate`` here would leave each rank with its own heads' gradient."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute(module, device_mesh, lambda param: Replicate())
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


def style_for(name: str, sequence_parallel: bool, loss_parallel: bool, input_shared: bool = False,
              rope_dim: int = 0) -> ParallelStyle:
    """The torch `ParallelStyle` for a style name, in the current SP / loss-parallel mode.

    ``input_shared``: the enclosing module hands its projections one replicated input (see `apply_tp`).
    ``rope_dim``: for ``mla_kv_a_proj``, the width of the shared rotary key at the end of its output.
    """
    residual = Shard(SEQUENCE_DIM) if sequence_parallel else Replicate()
    # Colwise layers declare the layout they receive: torch redistributes by the declared layout, not
    # by the actual placement of a DTensor input, so a sequence-sharded input must be declared as such.
    # A shared replicated input is declared Replicate: a (no-op) redistribute would all-reduce each
    # projection's input gradient in backward instead of leaving one reduction to the shared input.
    colwise_input = Replicate() if input_shared else residual
    if name == "colwise":
        return FusedColwiseParallel(input_layouts=colwise_input)
    if name in PACKED_PARTS:
        return FusedColwiseParallel(parts=PACKED_PARTS[name], input_layouts=colwise_input)
    if name == "colwise_rep":
        return FusedColwiseParallel(input_layouts=colwise_input, output_layouts=Replicate())
    if name == "rowwise":
        return Conv1DRowwiseParallel(output_layouts=residual, use_local_output=not sequence_parallel)
    if name == "per_head_rowwise":
        return PerHeadRowwiseParallel()
    if name == "rowwise_shared_output":
        return RowwiseSharedOutput()
    if name in ("stacked_colwise", "stacked_packed_colwise"):
        return StackedColwise(parts=2 if name == "stacked_packed_colwise" else 1)
    if name == "stacked_rowwise":
        return StackedRowwise()
    if name == "rowwise_split_input":
        return Conv1DRowwiseParallel(input_layouts=Replicate(), output_layouts=residual,
                                     use_local_output=not sequence_parallel)
    if name == "embedding_rowwise":
        # Replicated even under SP: code between the embedding and the first block (positions, masks)
        # sees an ordinary full tensor; the first block's pre-hook slices it (no communication).
        return EmbeddingRowwiseParallel(input_layouts=Replicate())
    if name == "embedding_colwise":
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if name == "colwise_gather_output":
        if loss_parallel:
            return FusedColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
        return FusedColwiseParallel(input_layouts=residual, output_layouts=Replicate())
    if name == "sequence_parallel":
        return ShardingSequenceParallel(sequence_dim=SEQUENCE_DIM)
    if name == "replicated_with_grad_allreduce":
        return ReplicatedPartialGrad()
    if name in ("per_head_params", "per_channel_vectors"):
        return PerHeadParameters(vectors_only=name == "per_channel_vectors")
    if name == "down_projection":
        return WholeOnSharedInput()
    if name == "mla_kv_a_proj":
        return WholeOnSharedInput(rope_dim=rope_dim)
    if name == "multihead_attention":
        return MultiheadAttentionParallel()
    if name == "transposed_experts":
        return TransposedExpertsParallel()
    raise ValueError(f"Unknown TP style {name!r}.")
