"""The inverse of splitting a batch into microbatches: what the microbatches gave, joined into what the whole batch
gives (the last stage's model outputs for ``predict_step``; a step's metric arguments, `metric_calls.py`).

Tensors of one or more dims are concatenated along dim 0 (the microbatches are consecutive rows of the batch, so a
tensor flattened over its leading dims joins too); lists are concatenated (one entry per sample); tuples, mappings and
Hugging Face ``ModelOutput``s are joined entry by entry; anything else (a scalar, a 0-dim tensor, a string, None) must
be the same in every microbatch, else it cannot be joined and the caller names it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence, Sized
from typing import Any, cast

import torch
from torch import Tensor


class NotJoinable(ValueError):
    """Microbatches gave values that do not make one batch's value; ``where`` names the value inside the structure."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


def join_microbatches(parts: Sequence[Any], where: str = "the value") -> Any:
    """One batch's value from its microbatches' ``parts`` (in order)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, Tensor) and first.ndim:
        if not all(isinstance(part, Tensor) and part.shape[1:] == first.shape[1:] for part in parts):
            raise NotJoinable(where, "tensors whose shapes differ past dim 0 ("
                              + ", ".join(str(tuple(getattr(part, 'shape', ()))) for part in parts) + ")")
        return torch.cat(list(parts))
    if isinstance(first, list):
        return [item for part in _alike(parts, list, where) for item in part]
    if isinstance(first, tuple):
        pieces = [join_microbatches([part[i] for part in _alike(parts, tuple, where, len(first))], f"{where}[{i}]")
                  for i in range(len(first))]
        return type(first)(*pieces) if hasattr(first, "_fields") else type(first)(pieces)
    if isinstance(first, Mapping):
        keys = list(first)
        for part in parts:
            if not isinstance(part, Mapping) or list(part) != keys:
                raise NotJoinable(where, "mappings with other keys in other microbatches")
        return _alike_mapping(first, {key: join_microbatches([part[key] for part in parts], f"{where}[{key!r}]")
                                      for key in keys})
    if all(_same(part, first) for part in parts[1:]):
        return first
    raise NotJoinable(where, f"a {type(first).__name__} that differs between microbatches ("
                      + ", ".join(_short(part) for part in parts) + "), so no value stands for the whole batch")


def map_tensors(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``value`` with ``fn`` applied to every tensor inside its lists, tuples and dicts."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        items = [map_tensors(item, fn) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, Mapping):
        return _alike_mapping(value, {key: map_tensors(item, fn) for key, item in value.items()})
    return value


def _alike_mapping(like: Mapping, items: dict[str, Any]) -> Any:
    """``items`` as a mapping of ``like``'s type: a Hugging Face ``ModelOutput`` keeps its class and fields (its
    constructor's names may differ from its keys), another mapping is rebuilt from the items, or stays a dict."""
    if _is_model_output(like):
        rebuilt = copy.copy(like)
        for key, item in items.items():
            cast(Any, rebuilt)[key] = item
        return rebuilt
    try:
        return cast(Any, type(like))(items)
    except TypeError:
        return items


def _alike(parts: Sequence[Any], kind: type, where: str, length: int | None = None) -> Sequence[Any]:
    for part in parts:
        if not isinstance(part, kind) or (length is not None and len(cast(Sized, part)) != length):
            raise NotJoinable(where, f"a {kind.__name__} in one microbatch and {_short(part)} in another")
    return parts


def _is_model_output(value: Any) -> bool:
    return any(cls.__name__ == "ModelOutput" for cls in type(value).__mro__)


def _same(value: Any, other: Any) -> bool:
    if isinstance(value, Tensor) or isinstance(other, Tensor):
        return isinstance(value, Tensor) and isinstance(other, Tensor) and value.shape == other.shape \
            and bool(torch.equal(value.detach().cpu(), other.detach().cpu()))
    try:
        return bool(value == other)
    except Exception:  # noqa: BLE001 - values that cannot be compared are not the same
        return False


def _short(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"{value.item():.4g}" if value.numel() == 1 else f"tensor{tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
