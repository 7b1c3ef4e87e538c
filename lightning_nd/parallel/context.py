"""Sequence sharding for context parallelism: which positions each cp rank holds, and what that costs.

``contiguous``: rank r holds the r-th of cp equal chunks. Under a causal mask the last rank attends to
the whole sequence and the first to almost nothing. ``zigzag`` (head-tail): the sequence is cut into
2*cp chunks and rank r holds chunks r and 2*cp-1-r, so every rank has one early and one late chunk
and the same attention work.
"""

from __future__ import annotations

from typing import Literal

import torch

Sharding = Literal["contiguous", "zigzag"]


def shard_positions(seq_len: int, cp: int, rank: int, sharding: Sharding = "zigzag") -> torch.Tensor:
    """The global positions rank ``rank`` of ``cp`` holds, in the order its rows are stored."""
    if sharding not in ("contiguous", "zigzag"):
        raise ValueError(f"Unknown sharding {sharding!r}. HINT: use 'zigzag' (balanced) or 'contiguous'.")
    chunks = 2 * cp if sharding == "zigzag" else cp
    if seq_len % chunks:
        raise ValueError(
            f"sequence length {seq_len} does not divide into {chunks} equal chunks for {sharding} sharding over"
            f" cp={cp}. HINT: pad sequences to a multiple of {chunks}."
        )
    positions = torch.arange(seq_len).view(chunks, -1)
    if sharding == "contiguous":
        return positions[rank]
    return torch.cat([positions[rank], positions[chunks - 1 - rank]])


def attention_flops_per_rank(seq_len: int, cp: int, sharding: Sharding, *, causal: bool = True) -> list[int]:
    """Query-key pairs each rank scores (proportional to its attention FLOPs)."""
    work = []
    for rank in range(cp):
        positions = shard_positions(seq_len, cp, rank, sharding)
        work.append(int((positions + 1).sum()) if causal else positions.numel() * seq_len)
    return work
