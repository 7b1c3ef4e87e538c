"""Tensors shared by several modules (a head tied to the embedding), kept shared through ``to_empty``.

``Module.to_empty`` runs ``Module._apply`` module by module: a DTensor parameter is swapped in place (every module
still holds the same object), but a plain parameter becomes a new ``Parameter`` in each module that holds it, so a
tie made on the meta device would silently become two weights. Here every slot that held one tensor before holds
one tensor after: the one its first holder (in ``named_modules`` order) got.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

Slot = tuple[nn.Module, str, str]
"""A module, ``"_parameters"`` or ``"_buffers"``, and the tensor's name in it."""


def tensor_slots(module: nn.Module) -> Iterator[tuple[str, Slot, torch.Tensor]]:
    """Every (qualified name, slot, tensor) of ``module``, a shared tensor once per module that holds it."""
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(submodule, kind).items():
                if tensor is not None:
                    yield (f"{prefix}.{name}" if prefix else name), (submodule, kind, name), tensor


def shared_tensors(module: nn.Module) -> dict[int, list[Slot]]:
    """The slots of each tensor held in more than one slot, by the tensor's id (first holder first)."""
    slots: dict[int, list[Slot]] = {}
    for _, slot, tensor in tensor_slots(module):
        holders = slots.setdefault(id(tensor), [])
        if slot not in holders:
            holders.append(slot)
    return {key: holders for key, holders in slots.items() if len(holders) > 1}


def to_empty_keeping_ties(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device=device)``, every tie still one tensor afterwards."""
    shared = shared_tensors(module)
    module.to_empty(device=device)
    for holders in shared.values():
        first, kind, name = holders[0]
        tensor = getattr(first, kind)[name]
        for holder, holder_kind, holder_name in holders[1:]:
            getattr(holder, holder_kind)[holder_name] = tensor
