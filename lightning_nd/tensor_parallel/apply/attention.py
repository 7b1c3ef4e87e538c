"""``nn.MultiheadAttention`` split by heads: the ``multihead_attention`` style.

torch's module runs ``F.multi_head_attention_forward`` on its fused ``in_proj_weight`` with the full
``embed_dim``, and reads ``out_proj.weight`` without calling ``out_proj``; no `ParallelStyle` of its parts can
split it. This style splits its parameters by heads (``in_proj_weight`` part by part as ``[q; k; v]``, a
``_StridedShard``; separate ``q/k/v_proj_weight`` and ``bias_k``/``bias_v`` on their feature dim; the packed
``in_proj_bias`` whole, sliced in each forward as `FusedColwiseParallel` does) and replaces the module's
forward with the same computation on the rank's heads. Its ``out_proj`` is planned ``rowwise`` beside it and
called as a module, so its own hooks sum (or reduce-scatter, under sequence parallelism) the heads' outputs.
Inputs: a sequence-sharded DTensor is gathered, a replicated one used as is; in backward the input gradient is
summed over tp (one reduction when query, key and value are one tensor). Masks: 2-D, 3-D (per head: the
rank's heads are taken), boolean or additive, and ``key_padding_mask``; ``need_weights`` returns the weights
of all heads (averaged: a sum over tp; per head: gathered).
"""

from __future__ import annotations

from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_nd.tensor_parallel.apply.dropout import fork_rng_per_rank, has_dropout

PLACEMENTS = {"in_proj_weight": _StridedShard(0, split_factor=3), "in_proj_bias": Replicate(),
              "q_proj_weight": Shard(0), "k_proj_weight": Shard(0), "v_proj_weight": Shard(0),
              "bias_k": Shard(2), "bias_v": Shard(2)}
"""Each parameter's placement over tp (``bias_k``/``bias_v`` are ``[1, 1, embed_dim]``)."""


class MultiheadAttentionParallel(ParallelStyle):
    """Splits an ``nn.MultiheadAttention`` by heads (see the module docstring); its ``out_proj`` is planned
    ``rowwise`` on its own."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        attention = cast(nn.MultiheadAttention, module)
        for name, param in list(attention.named_parameters(recurse=False)):
            dist = distribute_tensor(param, device_mesh, [PLACEMENTS[name]])
            attention.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))
        setattr(attention, "forward", partial(local_heads_forward, attention, device_mesh))
        if has_dropout(attention):
            fork_rng_per_rank(attention, device_mesh.get_local_rank())
        return attention


def _local(param: torch.Tensor | None) -> torch.Tensor | None:
    return param.to_local() if isinstance(param, DTensor) else param


def packed_bias_slice(bias: DTensor, parts: int, mesh: DeviceMesh) -> torch.Tensor:
    """The rank's slice of each of the ``parts`` equal parts of a bias held whole over tp (a Replicate DTensor),
    concatenated as a part-by-part weight's output; its gradient, covering those slices only, is summed over tp."""
    whole = bias.to_local(grad_placements=[Partial()])
    return whole.view(parts, mesh.size(), -1)[:, mesh.get_local_rank()].reshape(-1)


def _whole_inputs(mesh: DeviceMesh, *values: torch.Tensor) -> list[torch.Tensor]:
    """Each input as a whole local tensor whose gradient is summed over tp; one tensor passed twice is
    converted once (self-attention: one reduction)."""
    done: dict[int, torch.Tensor] = {}
    for value in values:
        if id(value) not in done:
            dist = value if isinstance(value, DTensor) else DTensor.from_local(value, mesh, [Replicate()],
                                                                               run_check=False)
            done[id(value)] = dist.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
    return [done[id(value)] for value in values]


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: not attended) as the additive one torch's attention would build; an additive one in the
    queries' dtype (torch 2.13's CPU ``scaled_dot_product_attention`` given a float32 mask beside float64 queries
    returns wrong values on an AVX2 host, 2.2 off, silently; `nn.MultiheadAttention` whole gives the right ones)."""
    if mask is None:
        return None
    if mask.is_floating_point():
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def _projections(module: nn.MultiheadAttention, mesh: DeviceMesh, query, key, value):
    """q, k, v of the rank's heads, batch first."""
    packed = module.in_proj_bias
    bias = packed_bias_slice(packed, 3, mesh) if isinstance(packed, DTensor) else packed
    biases = bias.chunk(3) if bias is not None else (None, None, None)
    if module._qkv_same_embed_dim:
        weights = cast(torch.Tensor, _local(module.in_proj_weight)).chunk(3)
    else:
        weights = tuple(cast(torch.Tensor, _local(getattr(module, f"{p}_proj_weight"))) for p in "qkv")
    if query is key and key is value and module._qkv_same_embed_dim:
        return F.linear(query, torch.cat(weights), bias).chunk(3, dim=-1)
    return tuple(F.linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))


def local_heads_forward(module: nn.MultiheadAttention, mesh: DeviceMesh, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                        attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                        is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``nn.MultiheadAttention.forward`` on the rank's heads (same arguments, same results)."""
    tp, heads = mesh.size(), module.num_heads
    local_heads, head_dim = heads // tp, module.head_dim
    query, key, value = _whole_inputs(mesh, query, key, value)
    if not module.batch_first:  # this forward works batch first
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    q, k, v = _projections(module, mesh, query, key, value)
    batch, length = q.shape[0], q.shape[1]
    if module.bias_k is not None and module.bias_v is not None:
        k = torch.cat([k, cast(torch.Tensor, _local(module.bias_k)).expand(batch, 1, -1)], dim=1)
        v = torch.cat([v, cast(torch.Tensor, _local(module.bias_v)).expand(batch, 1, -1)], dim=1)
        attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
        key_padding_mask = F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None else None
    if module.add_zero_attn:
        k, v = (torch.cat([x, x.new_zeros(batch, 1, x.shape[-1])], dim=1) for x in (k, v))
        attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
        key_padding_mask = F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None else None
    q, k, v = (x.reshape(batch, x.shape[1], local_heads, head_dim).transpose(1, 2) for x in (q, k, v))
    mask = _local_mask(_additive(attn_mask, q.dtype), batch, heads, mesh)
    if key_padding_mask is not None:
        padding = _additive(key_padding_mask, q.dtype).view(batch, 1, 1, -1)  # type: ignore[union-attr]
        mask = padding if mask is None else mask + padding
    causal = is_causal and mask is None
    dropout = module.dropout if module.training else 0.0
    if need_weights:
        scores = q @ k.transpose(-2, -1) / head_dim**0.5
        if causal:
            scores = scores.masked_fill(torch.ones(length, k.shape[2], dtype=torch.bool, device=q.device).triu(1),
                                        float("-inf"))
        weights = torch.softmax(scores + mask if mask is not None else scores, dim=-1)
        out = F.dropout(weights, dropout) @ v
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
    out = out.transpose(1, 2).reshape(batch, length, local_heads * head_dim)
    output = module.out_proj(out if module.batch_first else out.transpose(0, 1))
    return output, (_all_heads_weights(weights, heads, average_attn_weights, mesh) if need_weights else None)


def _local_mask(mask: torch.Tensor | None, batch: int, heads: int, mesh: DeviceMesh) -> torch.Tensor | None:
    """A per-head ``[batch * heads, L, S]`` mask restricted to the rank's heads; a 2-D one as it is."""
    if mask is None or mask.dim() == 2:
        return mask
    local = heads // mesh.size()
    per_head = mask.view(batch, heads, *mask.shape[-2:])
    return per_head[:, mesh.get_local_rank() * local:(mesh.get_local_rank() + 1) * local]


def _all_heads_weights(weights: torch.Tensor, heads: int, average: bool, mesh: DeviceMesh) -> torch.Tensor:
    if average:  # the mean over all heads: each rank's sum over its heads, summed over tp
        partial_sum = DTensor.from_local(weights.sum(dim=1) / heads, mesh, [Partial()], run_check=False)
        return partial_sum.redistribute(placements=[Replicate()]).to_local()
    return DTensor.from_local(weights, mesh, [Shard(1)], run_check=False).full_tensor()
