"""Tensors a model's construction made as constants (``torch.zeros``, ``torch.ones``, ``torch.full`` and their
``_like`` / ``new_`` forms, then only ``fill_`` / ``zero_`` of the whole tensor), which materialising fills again
before any ``reset_parameters()``: a buffer or parameter made that way keeps its value on every rank, also in a
module with no ``reset_parameters()`` (LitGPT's ``GroupedTopkRouter.e_score_correction_bias``, a learnable
``nn.Parameter(torch.ones(width))``) or in one whose ``reset_parameters()`` does not touch it.

The values are read from the operations torch's dispatcher runs while the model is built on the meta device
(`init_record.py`), so nothing about any model's code is assumed."""

from __future__ import annotations

from typing import Any

import torch

_FILLED_WITH = {  # operation -> where its value is: a constant, or the index of the argument holding it
    "aten::zeros": 0, "aten::zeros_like": 0, "aten::new_zeros": 0,
    "aten::ones": 1, "aten::ones_like": 1, "aten::new_ones": 1,
}
_FILLED_FROM = {"aten::full": 1, "aten::full_like": 1, "aten::new_full": 2}
_REFILLS = {"aten::fill_": 1, "aten::zero_": None}
UNKNOWN = object()
"""The value of an operation that does not make or fill a whole tensor with one constant."""


def _name(func: Any) -> str:
    schema = getattr(func, "_schema", None)
    return schema.name if schema is not None else ""


def made_constant(func: Any, args: tuple) -> Any:
    """The value an operation made a new tensor of, or `UNKNOWN`."""
    name = _name(func)
    if name in _FILLED_WITH:
        return _FILLED_WITH[name]
    index = _FILLED_FROM.get(name)
    if index is not None and index < len(args) and isinstance(args[index], (bool, int, float)):
        return args[index]
    return UNKNOWN


def refilled(func: Any, args: tuple) -> Any:
    """The value an in-place ``fill_`` / ``zero_`` gave its whole tensor, or `UNKNOWN` (another write, a part of a
    tensor, a value held in a tensor)."""
    name = _name(func)
    if name not in _REFILLS or not args or not isinstance(args[0], torch.Tensor) or not whole(args[0]):
        return UNKNOWN
    index = _REFILLS[name]
    if index is None:
        return 0
    value = args[index] if index < len(args) else None
    return value if isinstance(value, (bool, int, float)) else UNKNOWN


def whole(tensor: torch.Tensor) -> bool:
    """``tensor`` spans its whole storage (it is not a view of a part of another tensor)."""
    return tensor.storage_offset() == 0 and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
