"""Context-parallel attention that runs on CPU (gloo) and GPU: ring attention and an all-gather variant.

Each rank holds a slice of the sequence (its query, key and value rows, and their positions).
Ring: K and V travel around the cp group one hop per step; every rank attends its queries to each
visiting block with a fused kernel that returns the block's log-sum-exp (`block_kernels.py`) and merges
the partial results by it (online softmax). Under a causal mask, the parts of a block that lie above the
diagonal are not computed (`block_pairs.py`), but the hop still happens, so the ring stays whole. For backward
a rank keeps only its q, k, v, the output and the log-sum-exp (what one device's fused kernel keeps, divided
by cp): the backward sends K/V around the ring again and recomputes block by block, each block's dK/dV
travelling with it and arriving home after one more hop. Each hop is posted before the block is computed and
waited for after it, so the transfer overlaps the kernel where the backend sends asynchronously (NCCL; gloo's
transport threads on CPU). K and V travel as one stacked tensor.

All-gather: K and V are gathered once and each rank attends to all of them with plain matmuls under autograd,
which keep the scores [S_local, S] for backward: simpler, one collective, and far more memory at long sequences.
Both are exact (not approximations); causal masking uses the true positions, so any sharding (contiguous or
head-tail "zigzag") is correct.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import ProcessGroup

from lightning_nd.context_parallel.block_kernels import block_backward, block_forward
from lightning_nd.context_parallel.block_pairs import Pair, block_pairs
from lightning_nd.context_parallel.communication import GRAD_TAG, KV_TAG, RingHop, gather_positions


class _Ring(torch.autograd.Function):
    """Ring attention with a backward of its own: forward keeps this rank's q, k, v, the output and the
    log-sum-exp, nothing per block; backward sends K/V around the ring again and recomputes block by block, each
    block's dK/dV travelling with it and arriving home after the last hop."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                every: torch.Tensor, group: ProcessGroup, causal: bool, scale: float,
                report: Callable[[str, dict], None] | None) -> torch.Tensor:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        dtype = torch.promote_types(q.dtype, torch.float32)  # the merge runs in fp32 whatever the inputs
        out = torch.zeros(q.shape, dtype=dtype, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
        kv = torch.stack([k, v])  # one tensor per hop: K and V travel together
        pairs = [block_pairs(positions, every[(rank - step) % size], causal) for step in range(size)]
        for step in range(size):
            hop = RingHop(group, kv, report, KV_TAG) if step + 1 < size else None  # travels while this block computes
            for pair in pairs[step]:
                block_out, block_lse = block_forward(q[:, :, pair.q], kv[0][:, :, pair.k], kv[1][:, :, pair.k],
                                                     causal=pair.kind == "causal", scale=scale, mask=_on(pair, q))
                _merge_into(out, lse, pair.q, block_out, block_lse)
            if hop is not None:
                kv = hop.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = (pairs, group, scale, report)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        pairs, group, scale, report = ctx.ring
        size = dist.get_world_size(group)
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        kv, grads = torch.stack([k, v]), None
        for step in range(size):
            hop = RingHop(group, kv, report, KV_TAG) if step + 1 < size else None
            block_grad = torch.zeros((2, *k.shape), dtype=lse.dtype, device=k.device)
            for pair in pairs[step]:
                rows = pair.q
                dq_part, dk_part, dv_part = block_backward(
                    grad[:, :, rows], q[:, :, rows], kv[0][:, :, pair.k], kv[1][:, :, pair.k], out[:, :, rows],
                    lse[:, :, rows], causal=pair.kind == "causal", scale=scale, mask=_on(pair, q))
                dq[:, :, rows] += dq_part
                block_grad[0][:, :, pair.k] += dk_part
                block_grad[1][:, :, pair.k] += dv_part
            if grads is not None:
                block_grad += grads.wait()  # what the ranks before this one added to this block's dK/dV
            if hop is not None:
                kv = hop.wait()
            grads = RingHop(group, block_grad, report, GRAD_TAG) if size > 1 else None
            home = block_grad
        if grads is not None:
            home = grads.wait()  # this rank's own block, after its last hop
        return (dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), *([None] * 6))


def _on(pair: Pair, q: torch.Tensor) -> torch.Tensor | None:
    return pair.mask.to(q.device) if pair.mask is not None else None


def _merge_into(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor,
                block_lse: torch.Tensor) -> None:
    """Fold one block's softmax-normalised result for queries ``rows`` into the running one, by log-sum-exp."""
    merged = torch.logaddexp(lse[:, :, rows], block_lse.to(lse.dtype))
    finite = merged.clamp_min(torch.finfo(merged.dtype).min)  # a row no key reached so far stays 0, not NaN
    out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - finite)[..., None]
                       + block_out.to(out.dtype) * torch.exp(block_lse.to(lse.dtype) - finite)[..., None])
    lse[:, :, rows] = merged


def _block(q, kv, q_pos, k_pos, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, Hkv, G, Sq, D] to one block of stacked K/V [2, B, Hkv, Sk, D]: output and log-sum-exp."""
    # Scores, softmax and the merge run in fp32 whatever the inputs (bf16 errors would add up over the ring).
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v = q.to(dtype), kv[0][:, :, None].to(dtype), kv[1][:, :, None].to(dtype)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    # A fully masked row has lse = -inf; clamping keeps its probabilities 0 instead of NaN.
    probs = torch.exp(scores - lse.clamp_min(torch.finfo(scores.dtype).min))
    return torch.matmul(probs, v), lse


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    batch, heads, seq, dim = q.shape
    return q.view(batch, kv_heads, heads // kv_heads, seq, dim)


def _checked_scale(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   scale: float | None) -> float:
    """Validate the shapes; the softmax scale (1/sqrt(head_dim) unless given)."""
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"ring attention expects q [B, H, S, D] and k, v [B, Hkv, S, D]; got q {tuple(q.shape)},"
                         f" k {tuple(k.shape)}, v {tuple(v.shape)}.")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads.")
    if positions.shape != (q.shape[2],):
        raise ValueError(f"`positions` must hold one position per local token ({q.shape[2]}), got"
                         f" {tuple(positions.shape)}.")
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    group: ProcessGroup,
    *,
    causal: bool = True,
    scale: float | None = None,
    report: Callable[[str, dict], None] | None = None,
    every_position: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention of this rank's queries to the keys of every rank in ``group``, passing K/V around a ring.

    ``q`` [B, H, S_local, D], ``k``/``v`` [B, Hkv, S_local, D] (grouped-query when Hkv < H), ``positions``
    [S_local]: the global sequence position of each local token (the same on every rank for its rows).
    ``every_position`` [cp, S_local]: every rank's positions, when the caller knows them (else one small
    all-gather finds them). ``report(kind, fields)``, when given, hears of each hop's send and receive, issued
    and completed.
    """
    scale = _checked_scale(q, k, v, positions, scale)
    if every_position is None:
        every_position = gather_positions(positions, group).view(dist.get_world_size(group), -1)
    return _Ring.apply(q, k, v, positions.cpu(), every_position.cpu(), group, causal, scale, report)


def all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    group: ProcessGroup,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """The same result as `ring_attention` with one all-gather of K/V (more memory, one collective)."""
    from torch.distributed._functional_collectives import all_gather_tensor_autograd, wait_tensor

    scale = _checked_scale(q, k, v, positions, scale)
    # The autograd all-gather of torch.distributed.nn scatters from global rank 0 in backward, which breaks
    # on sub-groups; the functional collective's backward is a reduce-scatter over the group itself.
    gathered = wait_tensor(all_gather_tensor_autograd(torch.stack([k, v]).contiguous(), gather_dim=3, group=group))
    out, _ = _block(_grouped(q, k.shape[1]), gathered, positions, gather_positions(positions, group), causal, scale)
    return out.to(q.dtype).reshape(q.shape)
