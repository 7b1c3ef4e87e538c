"""Run on each of 4 ranks: ring and all-gather attention for cp=4 (all ranks) and cp=2 (two groups),
outputs and dq/dk/dv gathered back into sequence order and compared with plain attention."""

from __future__ import annotations

import datetime
import itertools
import math

import torch
import torch.distributed as dist

from lightning_nd.context_parallel.ring_attention import all_gather_attention, ring_attention
from lightning_nd.context_parallel.sharding import shard_positions

BATCH, HEADS, SEQ, DIM = 2, 4, 32, 8


def reference(q, k, v, causal):
    """Plain attention, written out (grouped-query by repeating K/V heads)."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _one_case(group, dtype, causal, kv_heads, impl, sharding):
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(BATCH, heads, SEQ, DIM, generator=generator, dtype=dtype)
               for heads in (HEADS, kv_heads, kv_heads))
    grad_out = torch.randn(BATCH, HEADS, SEQ, DIM, generator=generator, dtype=dtype)
    positions = shard_positions(SEQ, cp, rank, sharding)
    local = [t[:, :, positions].clone().requires_grad_() for t in (q, k, v)]
    attention = ring_attention if impl == "ring" else all_gather_attention
    out = attention(*local, positions, group, causal=causal)
    out.backward(grad_out[:, :, positions])
    full = [q.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_()]
    expected = reference(*full, causal)
    expected.backward(grad_out)
    errors = {"out": (out - expected[:, :, positions]).abs().max().item()}
    for name, mine, theirs in zip(("dq", "dk", "dv"), local, full):
        errors[name] = (mine.grad - theirs.grad[:, :, positions]).abs().max().item()
    return errors


def run_all() -> dict[str, dict[str, float]]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    world, rank = dist.get_world_size(), dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {4: dist.group.WORLD, 2: pairs[rank // 2]}
    results = {}
    for cp, dtype, causal, kv_heads, impl in itertools.product(
        (2, 4), (torch.float64, torch.float32), (True, False), (HEADS, 2), ("ring", "all_gather")
    ):
        shardings = ("zigzag", "contiguous") if causal else ("contiguous",)
        for sharding in shardings:
            key = f"cp{cp}-{str(dtype)[6:]}-{'causal' if causal else 'full'}-kv{kv_heads}-{impl}-{sharding}"
            results[key] = _one_case(groups[cp], dtype, causal, kv_heads, impl, sharding)
    assert world == 4
    return results
