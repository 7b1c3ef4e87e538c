"""What a batch looks like to the planner and the strategy: its tensors, the shape of its token ids and so its
sequence length (the length context parallelism splits and sequence parallelism divides).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def tensors_of(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


def token_shape(batch: object) -> tuple[int, int] | None:
    """[batch, seq] of a batch's first integer two-dimensional tensor (its token ids)."""
    for tensor in tensors_of(batch):
        if tensor.ndim == 2 and not tensor.is_floating_point() and tensor.dtype != torch.bool:
            return int(tensor.shape[0]), int(tensor.shape[1])
    return None


def whole_tokens(batch: object, cp: int) -> tuple[int, int] | None:
    """(tokens, full sequence length) of a rank's batch whose sequence is sharded over ``cp`` ranks: the tokens
    its batch rank trains this step, counted once for the cp group."""
    shape = token_shape(batch)
    return (shape[0] * shape[1] * cp, shape[1] * cp) if shape is not None else None


def sequence_length(batch: object) -> int | None:
    """The sequence length of a batch: dim 1 of its first integer [batch, seq] tensor (token ids)."""
    shape = token_shape(batch)
    return shape[1] if shape is not None else None
