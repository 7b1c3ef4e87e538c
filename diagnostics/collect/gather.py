"""Every rank's few floats, on every rank: the one all-gather each monitor makes every N steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def gather_floats(values: Sequence[float], device: Any, world_size: int) -> list[list[float]]:
    """``values`` (the same length on every rank) from every rank, by rank; gathered on ``device`` (the module's:
    NCCL gathers device tensors only). Without a process group, this rank's alone."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(list(values), dtype=torch.float64, device=device)
    if not dist.is_initialized():
        return [mine.tolist()]
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    return [tensor.tolist() for tensor in everyone]
