"""Linear and embedding layers split over tp, beyond torch's colwise/rowwise: GPT-2's ``Conv1D`` (a linear layer whose
weight is stored ``[in, out]``), fused weights of equal parts split part by part (``[gate; up]``, GPT-2's
``[q; k; v]``), Hugging Face's ``colwise_rep`` and ``rowwise_split_input``, a vocabulary-split embedding, and rowwise
layers whose output a shared residual or per-head module reads.
"""

from __future__ import annotations

from functools import partial
from typing import cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_nd.model.structure import is_conv1d
from lightning_nd.tensor_parallel.apply.attention import packed_bias_slice
from lightning_nd.tensor_parallel.apply.forward_views import restore_parameters, swap_parameters
from lightning_nd.tensor_parallel.communication import reduce_from_tp


def distribute_parameters(module: nn.Module, device_mesh: DeviceMesh, placement_of) -> None:
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
        distribute_parameters(module, device_mesh, lambda param: split(out_dim) if param == "weight" else packed_bias)

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
            lambda name, mod, mesh: distribute_parameters(mod, mesh,
                                                          lambda param: Shard(0) if param == "weight" else Replicate()),
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
