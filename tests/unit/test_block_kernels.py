"""One ring block on one process: the fused CPU kernel and the plain one agree with autograd's attention, forward
and backward from the merged output and log-sum-exp; the causal pairs of head-tail shards are computed, skipped
and joined as `block_pairs` says, with the same work on every rank."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_nd.context_parallel import block_kernels
from lightning_nd.context_parallel.block_kernels import block_backward, block_forward
from lightning_nd.context_parallel.block_pairs import block_pairs
from lightning_nd.context_parallel.sharding import attention_flops_per_rank, every_shard_positions


def _reference(q, k, v, mask):
    groups = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v.repeat_interleave(groups, 1)


@pytest.mark.parametrize("kernel, kind", [("cpu_flash", "full"), ("cpu_flash", "causal"), ("plain", "full"),
                                          ("plain", "causal"), ("plain", "masked")])  # a mask always runs plain
def test_two_blocks_merged_and_differentiated_from_the_whole_output_equal_attention(monkeypatch, kernel, kind):
    if kernel == "plain":
        monkeypatch.setattr(block_kernels, "_kernel", lambda *args: "plain")
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    k, v = (torch.randn(2, 2, 6, 8, dtype=torch.float64, generator=generator, requires_grad=True) for _ in "kv")
    grad = torch.randn(2, 4, 6, 8, dtype=torch.float64, generator=generator)
    mask = {"full": torch.ones(6, 6, dtype=torch.bool), "causal": torch.ones(6, 6, dtype=torch.bool).tril(),
            "masked": torch.rand(6, 6, generator=generator) > 0.4}[kind]
    mask[:, 0] = True  # every query sees a key
    expected = _reference(q, k, v, mask)
    expected.backward(grad)
    scale = 1 / math.sqrt(8)
    halves = [slice(0, 3), slice(3, 6)] if kind != "causal" else [slice(0, 6)]
    blocks = []
    for cols in halves:
        options = {"causal": kind == "causal", "scale": scale, "mask": mask[:, cols] if kind == "masked" else None}
        blocks.append((cols, options, *block_forward(q.detach(), k.detach()[:, :, cols], v.detach()[:, :, cols],
                                                     **options)))
    lse = torch.logsumexp(torch.stack([b[3] for b in blocks]), 0)
    out = sum(b[2] * torch.exp(b[3] - lse)[..., None] for b in blocks)
    assert torch.allclose(out, expected, atol=1e-12)
    dq = torch.zeros_like(q)
    for cols, options, _, _ in blocks:
        dq_part, dk_part, dv_part = block_backward(grad, q.detach(), k.detach()[:, :, cols], v.detach()[:, :, cols],
                                                   out, lse, **options)
        dq += dq_part
        assert torch.allclose(dk_part, k.grad[:, :, cols], atol=1e-12)
        assert torch.allclose(dv_part, v.grad[:, :, cols], atol=1e-12)
    assert torch.allclose(dq, q.grad, atol=1e-12)


def test_head_tail_shards_skip_what_lies_above_the_diagonal_and_work_alike():
    cp, seq = 4, 64
    chunk = seq // (2 * cp)
    shards = every_shard_positions(seq, cp)
    own = block_pairs(shards[1], shards[1], causal=True)
    assert sorted((p.kind, p.q.start, p.k.start) for p in own) == [
        ("causal", 0, 0), ("causal", chunk, chunk), ("full", chunk, 0)]  # the early queries never see the late keys
    earlier = block_pairs(shards[1], shards[0], causal=True)  # all of rank 1's queries see rank 0's early chunk
    assert [(p.kind, p.q, p.k) for p in earlier] == [("full", slice(0, 2 * chunk), slice(0, chunk))]
    later = block_pairs(shards[1], shards[2], causal=True)  # only the late queries see rank 2's keys, all of them
    assert [(p.kind, p.q, p.k) for p in later] == [("full", slice(chunk, 2 * chunk), slice(0, 2 * chunk))]
    work = [sum(p.work for source in shards for p in block_pairs(shards[rank], source, causal=True))
            for rank in range(cp)]
    assert work == attention_flops_per_rank(seq, cp, "zigzag") and len(set(work)) == 1
    contiguous = every_shard_positions(seq, cp, "contiguous")
    assert block_pairs(contiguous[0], contiguous[3], causal=True) == []  # the first rank sees no later key


def test_irregular_positions_get_a_mask_that_is_the_causal_rule():
    queries, keys = torch.tensor([5, 6, 7, 2]), torch.tensor([4, 5, 6, 9])
    pairs = block_pairs(queries, keys, causal=True)
    seen = torch.zeros(4, 4, dtype=torch.bool)
    for pair in pairs:
        block = pair.mask if pair.kind == "masked" else torch.ones(pair.q.stop - pair.q.start,
                                                                    pair.k.stop - pair.k.start, dtype=torch.bool)
        if pair.kind == "causal":
            block = block.tril()
        seen[pair.q, pair.k] = block
    assert torch.equal(seen, queries[:, None] >= keys[None, :])
    assert block_pairs(queries, keys, causal=False)[0].work == 16


def test_a_query_whose_head_dim_is_strided_is_read_right():
    """The fused CPU kernel reads the head dim as contiguous: a transposed view must not reach it as is."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 8, 5, dtype=torch.float64, generator=generator).transpose(-1, -2)  # [1, 2, 5, 8]
    k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64, generator=generator) for _ in "kv")
    assert q.stride(-1) != 1
    out, _ = block_forward(q, k, v, causal=True, scale=1 / math.sqrt(8))
    assert torch.allclose(out, _reference(q, k, v, torch.ones(5, 5, dtype=torch.bool).tril()), atol=1e-12)
