"""Context-parallel attention that runs on CPU (gloo) and GPU: ring attention and an all-gather variant.

Each rank holds a slice of the sequence (its query, key and value rows, and their positions).
Ring: K and V travel around the cp group one hop per step; every rank attends its queries to each
visiting block and merges the partial results with their log-sum-exp (online softmax). All-gather:
K and V are gathered once and each rank attends to all of them. Both are exact (not approximations)
and differentiable; causal masking uses the true positions, so any sharding (contiguous or
head-tail "zigzag") is correct.

Two rules keep the backward right (both measured on gloo): every rotation stays in the autograd graph,
even when a block is fully masked (a skipped send would deadlock the backward ring), and K and V
travel as one stacked tensor (two collectives whose backward order can differ give wrong gradients).
Each hop is posted before the current block is computed and waited for after it, in forward and (the
gradients going back) in backward, so the transfer overlaps the block's matmuls where the backend
sends asynchronously (NCCL; gloo's transport threads on CPU).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import ProcessGroup

from lightning_nd.runtime.profiling import comm_label


class _Hop:
    """One ring hop in flight: its requests and buffers, shared by the start and the finish of the hop
    (forward: start sends K/V on, finish waits; backward: finish sends the gradient back, start waits)."""

    def __init__(self, group: ProcessGroup, report: Callable[[str, dict], None] | None = None) -> None:
        self.group, self.report = group, report
        self.peers: tuple[int, int] = (0, 0)
        self.requests: list = []
        self.sending: torch.Tensor | None = None
        self.received: torch.Tensor | None = None


class _StartHop(torch.autograd.Function):
    """Post the send of ``tensor`` to the next rank and the receive from the previous; return at once
    (an empty placeholder), so the caller computes while the bytes travel."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, hop: _Hop) -> torch.Tensor:
        ctx.hop = hop
        _post(hop, tensor, step=1)
        return tensor.new_empty(0)

    @staticmethod
    def backward(ctx, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _wait(ctx.hop), None


class _FinishHop(torch.autograd.Function):
    """Wait for the hop; in backward, post the gradient's way back and return at once."""

    @staticmethod
    def forward(ctx, placeholder: torch.Tensor, hop: _Hop) -> torch.Tensor:
        ctx.hop = hop
        return _wait(hop)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _post(ctx.hop, grad, step=-1)
        return grad.new_empty(0), None


def _post(hop: _Hop, tensor: torch.Tensor, step: int) -> None:
    size, rank = dist.get_world_size(hop.group), dist.get_rank(hop.group)
    send_to = dist.get_global_rank(hop.group, (rank + step) % size)
    recv_from = dist.get_global_rank(hop.group, (rank - step) % size)
    hop.sending = tensor.contiguous()  # gloo sends and receives contiguous buffers only; kept alive until done
    hop.received = torch.empty_like(hop.sending)
    with comm_label("cp", "ring_post"):
        hop.requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, hop.sending, send_to, hop.group),
            dist.P2POp(dist.irecv, hop.received, recv_from, hop.group),
        ])
    hop.peers = (send_to, recv_from)
    _tell(hop, "issued")


def _tell(hop: _Hop, state: str) -> None:
    """Report the hop's send and receive to whoever listens (the flight recorder does not record p2p on gloo)."""
    if hop.report is not None:
        assert hop.sending is not None, "told only while the hop is posted"
        size = hop.sending.numel() * hop.sending.element_size()
        for op, peer in zip(("send", "recv"), hop.peers):
            hop.report("p2p", {"op": op, "peer": peer, "bytes": size, "state": state, "time_s": time.perf_counter()})


def _wait(hop: _Hop) -> torch.Tensor:
    with comm_label("cp", "ring_wait"):
        for request in hop.requests:
            request.wait()
    _tell(hop, "completed")
    received, hop.requests, hop.sending, hop.received = hop.received, [], None, None
    assert received is not None, "waited only on a posted hop"
    return received


def _gather_positions(positions: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every rank's positions, concatenated in group-rank order (a small integer all-gather)."""
    gathered = [torch.empty_like(positions) for _ in range(dist.get_world_size(group))]
    with comm_label("cp", "positions"):
        dist.all_gather(gathered, positions.contiguous(), group=group)
    return torch.cat(gathered)


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


def _merge(out, lse, block_out, block_lse):
    """Combine two softmax-normalised partial results by their log-sum-exp."""
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    finite = new_lse.clamp_min(torch.finfo(new_lse.dtype).min)
    return out * torch.exp(lse - finite) + block_out * torch.exp(block_lse - finite), new_lse


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
        raise ValueError(f"`positions` must hold one position per local token ({q.shape[2]}), got {tuple(positions.shape)}.")
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
) -> torch.Tensor:
    """Exact attention of this rank's queries to the keys of every rank in ``group``, passing K/V around a ring.

    ``q`` [B, H, S_local, D], ``k``/``v`` [B, Hkv, S_local, D] (grouped-query when Hkv < H), ``positions``
    [S_local]: the global sequence position of each local token (the same on every rank for its rows).
    ``report(kind, fields)``, when given, hears of each hop's send and receive, issued and completed.
    """
    scale = _checked_scale(q, k, v, positions, scale)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    every_position = _gather_positions(positions, group).view(size, -1)
    grouped_q = _grouped(q, k.shape[1])
    kv = torch.stack([k, v])
    out = lse = None
    for step in range(size):
        # The next hop travels while this block is computed: one stacked tensor per hop, kept in the
        # graph even when the block is fully masked. Backward overlaps the same way, in reverse.
        hop = _Hop(group, report) if step + 1 < size else None
        placeholder = _StartHop.apply(kv, hop) if hop else None
        source = (rank - step) % size
        out, lse = _merge(out, lse, *_block(grouped_q, kv, positions, every_position[source], causal, scale))
        if hop:
            kv = _FinishHop.apply(placeholder, hop)
    assert out is not None, "the ring has at least one step"
    return out.to(q.dtype).reshape(q.shape)


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
    out, _ = _block(_grouped(q, k.shape[1]), gathered, positions, _gather_positions(positions, group), causal, scale)
    return out.to(q.dtype).reshape(q.shape)
