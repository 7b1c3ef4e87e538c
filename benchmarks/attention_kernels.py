"""Ring attention's block kernels on this machine's device: which kernel each dtype gets, and that two blocks merged
by their log-sum-exp and differentiated from the merged output equal torch's own SDPA, forward and backward.

    python benchmarks/attention_kernels.py             # CUDA when present (flash for bf16, efficient for fp32)
    python benchmarks/attention_kernels.py --device cpu

Exits 1 when a difference exceeds its tolerance (bf16: 2e-2, fp32: 2e-4 relative to the largest value), so
`benchmarks/gpu_check.sh` fails on a CUDA kernel the CPU tests never ran.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_nd.context_parallel import block_kernels  # noqa: E402

TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 2e-4}


def check(device: str, dtype: torch.dtype, causal: bool) -> tuple[str, float]:
    """The kernel used and the largest relative difference over output, dq, dk and dv."""
    generator = torch.Generator(device).manual_seed(0)
    q = torch.randn(2, 8, 256, 64, device=device, dtype=dtype, generator=generator, requires_grad=True)
    k, v = (torch.randn(2, 2, 256, 64, device=device, dtype=dtype, generator=generator, requires_grad=True)
            for _ in "kv")
    grad = torch.randn_like(q)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    expected.backward(grad)
    scale = 1 / math.sqrt(64)
    # causal: the diagonal block (keys 128-255 for queries 128-255) and the block before it, seen fully
    rows = slice(128, 256) if causal else slice(0, 256)
    blocks = [(slice(0, 128), False), (slice(128, 256), causal)]
    query = q.detach()[:, :, rows]
    parts = [(cols, is_causal, *block_kernels.block_forward(query, k.detach()[:, :, cols], v.detach()[:, :, cols],
                                                               causal=is_causal, scale=scale))
             for cols, is_causal in blocks]
    lse = torch.logsumexp(torch.stack([part[3].float() for part in parts]), 0)
    out = sum(part[2].float() * torch.exp(part[3].float() - lse)[..., None] for part in parts).to(dtype)
    errors = [_relative(out, expected[:, :, rows])]
    dq = torch.zeros_like(query, dtype=torch.float32)
    for cols, is_causal, _, _ in parts:
        dq_part, dk_part, dv_part = block_kernels.block_backward(
            grad[:, :, rows], query, k.detach()[:, :, cols], v.detach()[:, :, cols], out, lse, causal=is_causal,
            scale=scale)
        dq += dq_part.float()
        if not causal:  # under causal, earlier queries also reach these keys: their gradient is not this one's
            errors += [_relative(dk_part, k.grad[:, :, cols]), _relative(dv_part, v.grad[:, :, cols])]
    errors.append(_relative(dq, q.grad[:, :, rows]))
    return block_kernels._kernel(query, k, causal, None), max(errors)


def _relative(mine: torch.Tensor, reference: torch.Tensor) -> float:
    mine, reference = mine.detach().float(), reference.detach().float()
    return float((mine - reference).abs().max() / reference.abs().max())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = parser.parse_args().device
    failed = False
    print(f"{'device':>6} {'dtype':>9} {'mask':>7} {'kernel':>15} {'max rel. diff':>14}")
    for dtype in (torch.bfloat16, torch.float32):
        for causal in (False, True):
            kernel, error = check(device, dtype, causal)
            failed |= error > TOLERANCE[dtype]
            print(f"{device:>6} {str(dtype)[6:]:>9} {'causal' if causal else 'full':>7} {kernel:>15} {error:>14.2e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
