"""Parameters swapped for views during one forward: a style whose module computes on local tensors (a DTensor's
shard, the rank's slice of a whole bias) swaps them in before the forward and puts the DTensors back after it, so
the module's own code runs unchanged and the gradients still reach the DTensor parameters.

Pure torch: no Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
from torch import nn


def swap_parameters(module: nn.Module, views: Mapping[str, torch.Tensor]) -> None:
    """For this forward, ``module`` computes with ``views`` in place of its parameters of those names."""
    setattr(module, "_dtensor_parameters", {name: module._parameters[name] for name in views})
    module._parameters.update(cast(Mapping[str, nn.Parameter], views))  # views, not Parameters, for one forward


def restore_parameters(module: nn.Module, *_: object) -> None:
    """Put back what `swap_parameters` swapped (usable as a forward hook)."""
    module._parameters.update(module.__dict__.pop("_dtensor_parameters"))
