"""What a fake tensor reads as when code asks for its value.

A fake tensor has a shape and no values; a step asks for values in three ways. What is computed from the batch
alone, and integer or boolean tensors made from nothing (positions, masks, the pipeline's microbatch numbers made with
``torch.arange``; up to `REAL_FACTORY_ELEMENTS`), does not depend on the weights: it is made for real, so code that
reads it (Hugging Face decides from an all-ones mask that it may skip the mask, and treats any fake tensor as traced)
takes the cluster's path. A
logged number (``self.log``, a float read to combine microbatches or show it) does not change what runs: it reads as
0.0. Control flow on values computed from the weights (``if loss.isnan()``, token counts per expert) cannot be
guessed without risking a wrong verdict, so it stops the check of that rank and is reported as not checked
(`DataDependentOutputException`, with the module that asked).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, is_fake, unset_fake_temporarily

ARANGE = (torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)
REAL_FACTORY_ELEMENTS = 1 << 24
"""The largest integer or boolean tensor made from nothing that is made for real (16M elements: 128 MB of int64):
a bigger one (a [S, S] mask at a long sequence) is made fake, so the check never needs the cluster's memory."""


class CheckTensorMode(FakeTensorMode):
    """`FakeTensorMode` in which operations on real tensors only (and ``arange``) run for real, and a floating-point
    scalar read (``.item()``, ``float()``) of a value torch's constant propagation does not know (an optimizer's step
    count it does) gives 0.0."""

    def dispatch(self, func: Any, types: Sequence[type], args: Sequence[object] = (),
                 kwargs: Mapping[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor) and (
                args[0].is_floating_point() and getattr(args[0], "constant", None) is None):
            return 0.0
        if (func in ARANGE or (torch.Tag.nondeterministic_seeded not in func.tags and _real_data(args, kwargs))) and (
                _made_elements(func, args) <= REAL_FACTORY_ELEMENTS):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return super().dispatch(func, types, args, kwargs)


def _made_elements(func: Any, args: Sequence[object]) -> int:
    """How many elements a factory (``arange``, or a first argument that is a size) makes; 0 for other ops."""
    if func in ARANGE:
        numbers = [float(a) for a in args[:3] if isinstance(a, (int, float))]
        start, end, step = [0.0, *numbers, 1.0][:3] if len(numbers) == 1 else [*numbers, 1.0][:3]
        return max(0, math.ceil((end - start) / step))
    size = args[0] if args else None
    if isinstance(size, (list, tuple)) and all(isinstance(n, int) for n in size):
        return math.prod(size)
    return 0


def _real_data(args: Sequence[object], kwargs: Mapping[str, object]) -> bool:
    """Tensors among the arguments (one level into lists), none of them fake or on the meta device (a model's weights
    before they are made); or none, making integers or booleans (ids, masks, counts: never weights)."""
    seen = False
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, FakeTensor) or (isinstance(item, torch.Tensor) and item.is_meta):
                return False
            seen = seen or isinstance(item, torch.Tensor)
    dtype = kwargs.get("dtype")
    return seen or dtype in (torch.bool, torch.int32, torch.int64)


@contextmanager
def logging_outside_fake_tensors() -> Iterator[None]:
    """``LightningModule.log`` runs outside the fake mode on real zeros of the value's shape: Lightning keeps logged
    values in metric states it deep-copies, which a fake tensor cannot be."""
    log = LightningModule.log

    def real_log(self: LightningModule, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            if isinstance(value, torch.Tensor) and is_fake(value):
                value = torch.zeros(value.shape, dtype=value.dtype)
            log(self, name, value, *args, **kwargs)

    LightningModule.log = real_log  # type: ignore[method-assign]
    try:
        yield
    finally:
        LightningModule.log = log  # type: ignore[method-assign]
