"""The model's own init entry points (`model_init.py`), run again on the materialised shards of every copy this
rank holds, each random draw seeded by the tensor it fills and this rank's shard of it (`shard_seeds.py`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_nd.runtime.model_init import InitCall, run_calls, storage_key, written_tensors
from lightning_nd.runtime.shard_seeds import local, shard_identity, shard_seed
from lightning_nd.runtime.ties import tensor_slots


def replay(module: nn.Module, calls: Sequence[InitCall], seed: int, device: torch.device,
           original_name: Callable[[str], str]) -> None:
    """Each call again, on the module at its path in every copy this rank holds (``original_name`` maps this rank's
    module names to the whole model's: under pp, each stage holds a copy of the model with only its units)."""
    if not calls:
        return
    held: dict[str, list[nn.Module]] = {}
    for name, submodule in module.named_modules():
        copies = held.setdefault(original_name(name), [])
        if not any(copy is submodule for copy in copies):
            copies.append(submodule)
    names = {storage_key(local(tensor)): original_name(name) for name, _, tensor in tensor_slots(module)
             if not is_fake(tensor) and local(tensor).numel()}
    with _Reseeded(seed, names):
        for call in calls:
            try:
                run_calls([call], lambda path: held.get(path, []), device)
            except Exception as error:
                raise RuntimeError(
                    f"lightning-nd: running the model's own init {call.describe()} again on this rank's"
                    f" materialised shards failed ({type(error).__name__}: {error})."
                    " HINT: build the model in `__init__`, or pass `NDParallel(init_on_meta=False)`."
                ) from error


class _Reseeded(TorchDispatchMode):
    """Seeds every random operation by the tensor it fills (its name, and how many draws it had before) and this
    rank's shard of it; a draw into anything else (a temporary) by its place among those."""

    def __init__(self, seed: int, names: dict[int, str]) -> None:
        super().__init__()
        self.seed, self.names = seed, names
        self.draws: dict[str | None, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            written = written_tensors(func, args, kwargs)
            target = written[0] if written and not is_fake(written[0]) else None
            name = self.names.get(storage_key(local(target))) if target is not None else None
            self.draws[name] = draw = self.draws.get(name, 0) + 1
            identity = shard_identity(target) if target is not None and name is not None else ()
            torch.manual_seed(shard_seed(self.seed, ("init", name, draw), identity))
        return func(*args, **kwargs)
