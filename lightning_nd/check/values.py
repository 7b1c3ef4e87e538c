"""What a fake tensor reads as when code asks for its value.

A fake tensor has a shape and no values. A step asks for a value in three ways. A logged number (``self.log``, a
float read to combine microbatches or show it) does not change what runs: it reads as 0.0 here. A count made of
positions (``torch.arange``: the pipeline's microbatch numbers, which the schedule splits and the loss reads with
``int()``) does not depend on the weights: it keeps its real values. Control flow on data (``if loss.isnan()``, token
counts per expert, ``.tolist()`` of routing) cannot be guessed without risking a wrong verdict, so it stops the
check of that rank and is reported as not checked (`DataDependentOutputException`, with the module that asked).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake, unset_fake_temporarily

ARANGE = (torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)


class CheckTensorMode(FakeTensorMode):
    """`FakeTensorMode` in which a floating-point scalar read (``.item()``, ``float()``) of a value torch's constant
    propagation does not know (an optimizer's step count it does) gives 0.0, and ``arange`` keeps its values (the
    propagation then carries them through splits and views)."""

    def dispatch(self, func: Any, types: Sequence[type], args: Sequence[object] = (),
                 kwargs: Mapping[str, object] | None = None) -> object:
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], torch.Tensor) and (
                args[0].is_floating_point() and getattr(args[0], "constant", None) is None):
            return 0.0
        if func in ARANGE:
            with unset_fake_temporarily():
                real = func(*args, **(kwargs or {}))
            fake = self.from_tensor(real)
            fake.constant = real
            return fake
        return super().dispatch(func, types, args, kwargs or {})


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
