"""Sequence sharding for context parallelism: which positions each cp rank holds, and what that costs.

``contiguous``: rank r holds the r-th of cp equal chunks. Under a causal mask the last rank attends to
the whole sequence and the first to almost nothing. ``zigzag`` (head-tail): the sequence is cut into
2*cp chunks and rank r holds chunks r and 2*cp-1-r, so every rank has one early and one late chunk
and the same attention work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal, cast

import torch

from lightning_nd.model.batch import sequence_length

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


def every_shard_positions(seq_len: int, cp: int, sharding: Sharding = "zigzag") -> torch.Tensor:
    """Every rank's `shard_positions`, [cp, seq_len / cp]: what ring attention needs to know of the other ranks."""
    return torch.stack([shard_positions(seq_len, cp, rank, sharding) for rank in range(cp)])


def attention_flops_per_rank(seq_len: int, cp: int, sharding: Sharding, *, causal: bool = True) -> list[int]:
    """Query-key pairs each rank scores (proportional to its attention FLOPs)."""
    work = []
    for rank in range(cp):
        positions = shard_positions(seq_len, cp, rank, sharding)
        work.append(int((positions + 1).sum()) if causal else positions.numel() * seq_len)
    return work


def shard_sequence(batch: object, positions: torch.Tensor, seq_len: int, keys: Sequence[str] | None = None) -> object:
    """Every [batch, seq, ...] tensor of ``batch`` (dim 1 == ``seq_len``; or only the dict entries named in
    ``keys``) reduced to the rows at ``positions``, in that order. Other values pass unchanged."""

    def shard(value: object, name: str | None = None) -> object:
        if isinstance(value, torch.Tensor):
            wanted = name in keys if keys is not None else value.ndim >= 2 and value.shape[1] == seq_len
            return value.index_select(1, positions.to(value.device)) if wanted else value
        if isinstance(value, Mapping):
            # A batch's mapping type (a dict, Hugging Face's `BatchEncoding`) is built from a dict.
            return cast("Callable[[dict], object]", type(value))({k: shard(v, k) for k, v in value.items()})
        if isinstance(value, (list, tuple)):
            return type(value)(shard(v) for v in value)
        return value

    return shard(batch)


def shard_batch(batch: object, cp: int, rank: int, keys: Sequence[str] | None) -> tuple[object, torch.Tensor]:
    """This cp rank's zigzag shard of every sequence tensor of the batch, and the global positions it holds."""
    seq_len = sequence_length(batch)
    if seq_len is None:
        raise ValueError("Context parallelism splits the sequence, and the batch has no integer [batch, seq] tensor"
                         " (token ids) to read its length from. HINT: put token ids in the batch, or use cp=1.")
    if seq_len % (2 * cp):
        raise ValueError(
            f"`NDParallel(cp={cp})` splits each sequence into {2 * cp} chunks (two per rank, head and tail, so causal"
            f" attention work is balanced), but the batch's sequence length is {seq_len}. HINT: pad or crop sequences"
            f" to a multiple of {2 * cp}."
        )
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):
        raise ValueError(
            "Context parallelism got a batch whose `attention_mask` masks tokens (padding): ring attention covers"
            " causal and full attention over whole sequences only. HINT: pack sequences to one length without"
            " padding, or use cp=1."
        )
    positions = shard_positions(seq_len, cp, rank, "zigzag")
    return shard_sequence(batch, positions, seq_len, keys), positions
