"""One block of blockwise attention: queries against one block of keys, with the log-sum-exp, forward and backward.

`block_forward` returns a block's output and its log-sum-exp; `block_backward` takes the gradient of the *whole*
attention's output with that output and log-sum-exp (after every block was merged) and returns this block's share
of dq, dk, dv: with P = exp(S - lse), D = rowsum(dO * O), dS = P * (dP - D), which only needs the final O and lse
(FlashAttention-2, Dao 2023, algorithm 2). Nothing of a block is kept between its forward and its backward.

Kernels, chosen per call: on CPU torch's fused flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``, any float dtype, grouped-query natively); on CUDA the flash
kernel (fp16/bf16) or the memory-efficient one (fp32); a plain implementation otherwise, and for a block whose mask
is neither none nor the causal diagonal (it computes the block's scores, transiently). ``causal`` means the
diagonal of a square block: query i sees keys 0..i.
"""

from __future__ import annotations

import torch

Block = tuple[torch.Tensor, torch.Tensor]


def _kernel(q: torch.Tensor, k: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> str:
    if mask is not None:
        return "plain"
    if q.device.type == "cpu":
        return "cpu_flash"
    if q.device.type == "cuda":  # torch's own test of what the kernels take (dtype, head dim, GPU architecture)
        from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

        key = k.expand(-1, q.shape[1], -1, -1) if k.shape[1] != q.shape[1] else k
        params = SDPAParams(q, key, key, None, 0.0, causal, False)
        if can_use_flash_attention(params, False) and q.shape[-1] % 8 == 0:  # SDPA pads other head dims first
            return "cuda_flash"
        if can_use_efficient_attention(params, False):
            return "cuda_efficient"
    return "plain"


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                  mask: torch.Tensor | None = None) -> Block:
    """Attention of ``q`` [B, H, Sq, D] to ``k``/``v`` [B, Hkv, Sk, D]: output [B, H, Sq, D] in q's dtype and
    log-sum-exp [B, H, Sq] in fp32 (fp64 for fp64 inputs). ``mask`` [Sq, Sk], True where a query sees a key."""
    kernel = _kernel(q, k, causal, mask)
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    if kernel == "cpu_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    if kernel == "cuda_flash":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, *_expanded(q, k, v), 0.0, causal,
                                                                         scale=scale)
        return out, lse
    if kernel == "cuda_efficient":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, *_expanded(q, k, v), None, True,
                                                                             0.0, causal, scale=scale)
        return out, lse[..., :q.shape[-2]]  # the kernel pads the log-sum-exp's rows to a multiple of 32
    return _plain_forward(q, k, v, causal, scale, mask)


def block_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, *, causal: bool, scale: float,
                   mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's dq, dk, dv, from the whole attention's ``out``, ``lse`` and output gradient ``grad``."""
    kernel = _kernel(q, k, causal, mask)
    q, k, v, grad = _unit_stride(q), _unit_stride(k), _unit_stride(v), _unit_stride(grad)
    if kernel == "cpu_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, scale=scale)
    if kernel == "plain":
        return _plain_backward(grad, q, k, v, out, lse, causal, scale, mask)
    key, value = _expanded(q, k, v)
    empty = torch.empty(0, device=q.device)
    if kernel == "cuda_flash":
        sq, sk = q.shape[-2], k.shape[-2]
        # No cumulative sequence lengths (None): given, they would mean variable-length batches.
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, key, value, out, lse.contiguous(), None, None, sq, sk, 0.0, causal, empty, empty, scale=scale)
    else:
        padded = torch.zeros(*lse.shape[:-1], -(-lse.shape[-1] // 32) * 32, dtype=lse.dtype, device=lse.device)
        padded[..., :lse.shape[-1]] = lse
        # The kernel reads ``out`` as a dense [B, S, H, D] tensor whatever its strides: a row slice of a
        # [B, H, S, D] output is laid out so first.
        dense = out.transpose(1, 2).contiguous().transpose(1, 2)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad, q, key, value, None, dense, padded, empty, empty, 0.0, [True, True, True, False], causal,
            scale=scale)
    return dq, _grouped_sum(dk, k.shape[1]), _grouped_sum(dv, k.shape[1])


def _unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    """The fused kernels read the head dim as contiguous (a transposed view gives wrong results, silently)."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V repeated to q's heads (the CUDA kernels' aten entries take equal head counts): transient."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _grouped_sum(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    batch, heads, seq, dim = grad.shape
    return grad.view(batch, kv_heads, heads // kv_heads, seq, dim).sum(2) if heads != kv_heads else grad


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled scores [B, Hkv, G, Sq, Sk] in the accumulation dtype, -inf where a query does not see a key."""
    batch, heads, sq, dim = q.shape
    grouped = q.view(batch, k.shape[1], heads // k.shape[1], sq, dim)
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(grouped.to(dtype), k[:, :, None].to(dtype).transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(sq, k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~mask, float("-inf")) if mask is not None else scores


def _plain_forward(q, k, v, causal, scale, mask) -> Block:
    scores = _scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    # A row that sees no key has lse = -inf; clamping keeps its probabilities 0 instead of NaN.
    probs = torch.exp(scores - lse.clamp_min(torch.finfo(scores.dtype).min)[..., None])
    out = torch.matmul(probs, v[:, :, None].to(scores.dtype))
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


def _plain_backward(grad, q, k, v, out, lse, causal, scale, mask):
    batch, heads, sq, dim = q.shape
    kv_heads = k.shape[1]
    scores = _scores(q, k, causal, scale, mask)
    dtype = scores.dtype
    lse = lse.view(batch, kv_heads, heads // kv_heads, sq).to(dtype)
    probs = torch.exp(scores - lse.clamp_min(torch.finfo(dtype).min)[..., None])
    grad = grad.view(batch, kv_heads, heads // kv_heads, sq, dim).to(dtype)
    out = out.view(batch, kv_heads, heads // kv_heads, sq, dim).to(dtype)
    value = v[:, :, None].to(dtype)
    dv = torch.matmul(probs.transpose(-1, -2), grad).sum(2)
    dscores = probs * (torch.matmul(grad, value.transpose(-1, -2)) - (grad * out).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(dscores, k[:, :, None].to(dtype)).flatten(1, 2)
    dk = torch.matmul(dscores.transpose(-1, -2), q.view(batch, kv_heads, heads // kv_heads, sq, dim).to(dtype)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
