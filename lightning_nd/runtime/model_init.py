"""The model's own initialisation, as materialising a meta-device model replays it.

The contract (learned from torchtitan's ``init_weights()`` and transformers' ``post_init()`` / ``_init_weights``):
an init entry point counts when plain construction runs it, i.e. when the model's constructor (or
`configure_model`) calls it: ``init_weights()``, ``_init_weights(module)`` (usually through
``self.apply(self._init_weights)``), ``reset_parameters()`` / ``_reset_parameters()`` of a module on other modules'
tensors, or transformers' ``post_init()`` (whose weight initialisation, ``initialize_weights()``, is what is run
again). Each call is run again, with the same arguments, on the materialised shards. A method the constructor never
calls is never run. `init_record.py` records the calls while the model is built; `init_replay.py` replays them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_nd.runtime.ties import tensor_slots

ENTRY_METHODS = frozenset({"init_weights", "_init_weights", "reset_parameters", "_reset_parameters", "post_init"})
REPLAYED_AS = {"post_init": ("initialize_weights", "init_weights")}
"""transformers' ``post_init()`` also attaches plans and ties weights; its weight initialisation is
``initialize_weights()`` (then ``tie_weights()``, which materialising does not need: ties are kept)."""


@dataclass(frozen=True)
class ModulePath:
    """An argument that was a module of the model: the module at ``path`` where the call is made again."""

    path: str


@dataclass(frozen=True)
class InitCall:
    """``<module>.<method>(*positional, **keywords)``, as the model's construction called it on a ``kind``."""

    module: str
    kind: str
    """The class name of the module it was called on: under pp the stages' copies of the model are of that kind (so is
    FSDP's subclass of it), the wrapper that holds them at its path is not."""
    method: str
    positional: tuple[Any, ...] = ()
    keywords: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> str:
        shown = lambda value: f"`{value.path}`" if isinstance(value, ModulePath) else repr(value)  # noqa: E731
        arguments = [shown(v) for v in self.positional] + [f"{k}={shown(v)}" for k, v in self.keywords]
        return f"`{self.module or 'the LightningModule'}.{self.method}({', '.join(arguments)})`"


@dataclass(frozen=True)
class Lost:
    """A tensor whose initialisation materialising cannot give again, and where the model's code made it."""

    tensor: str
    where: str


@dataclass(frozen=True)
class ModelInit:
    """What materialising must do besides every module's ``reset_parameters()``: the entry points to replay, in
    order; the module that created each tensor shared by several (its ``reset_parameters()`` initialises it); the
    tensors the entry points initialise; the initialisations nothing replays (the run is refused); and the tensors
    made as constants, with their values (`init_constants.py`; filled before any ``reset_parameters()``)."""

    calls: tuple[InitCall, ...] = ()
    creators: tuple[tuple[str, str], ...] = ()
    covered: frozenset[str] = frozenset()
    lost: tuple[Lost, ...] = ()
    constants: tuple[tuple[str, bool | int | float], ...] = ()

    def __add__(self, other: ModelInit) -> ModelInit:
        return ModelInit(self.calls + other.calls, self.creators + other.creators, self.covered | other.covered,
                         self.lost + other.lost, self.constants + other.constants)


def storage_key(tensor: torch.Tensor) -> int:
    """Equal for a tensor and every alias of it (``param.data``, a view), also on the meta device."""
    return tensor.untyped_storage()._cdata


_WRITTEN: dict[Any, list[tuple[int, str]]] = {}


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an aten operation writes in place (its schema's ``Tensor(a!)`` arguments)."""
    positions = _WRITTEN.get(func)
    if positions is None:
        arguments = getattr(getattr(func, "_schema", None), "arguments", ())
        positions = _WRITTEN[func] = [(index, argument.name) for index, argument in enumerate(arguments)
                                      if argument.alias_info is not None and argument.alias_info.is_write]
    written: list[torch.Tensor] = []
    for index, name in positions:
        value = args[index] if index < len(args) else kwargs.get(name)
        written += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.Tensor)]
    return written


class Writes(TorchDispatchMode):
    """Hands every tensor an operation writes in place to ``on_write`` (before it runs), and every operation with
    its result to ``on_result`` (after)."""

    def __init__(self, on_write: Callable[[torch.Tensor], None],
                 on_result: Callable[[Any, tuple, Any], None] | None = None) -> None:
        super().__init__()
        self.on_write, self.on_result = on_write, on_result

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for tensor in written_tensors(func, args, kwargs):
            self.on_write(tensor)
        result = func(*args, **kwargs)
        if self.on_result is not None:
            self.on_result(func, args, result)
        return result


def run_calls(calls: Sequence[InitCall], modules_at: Callable[[str], Sequence[nn.Module]],
              device: torch.device | None = None) -> None:
    """Each call on every module held at its path (under pp one per stage copy), module arguments taken from the
    same copy; a call whose module or module argument this copy lacks (another stage's block) is skipped. A
    ``torch.device("meta")`` argument becomes ``device``."""
    for call in calls:
        for owner in modules_at(call.module):
            if all(cls.__name__ != call.kind for cls in type(owner).__mro__):
                continue
            resolve = lambda value: _argument(value, call.module, owner, modules_at, device)  # noqa: E731
            positional = [resolve(value) for value in call.positional]
            keywords = {key: resolve(value) for key, value in call.keywords}
            if any(value is _MISSING for value in [*positional, *keywords.values()]):
                continue
            method = next((name for name in REPLAYED_AS.get(call.method, ()) if hasattr(owner, name)), call.method)
            getattr(owner, method)(*positional, **keywords)


_MISSING = object()


def _argument(value: Any, owner_path: str, owner: nn.Module, modules_at: Callable[[str], Sequence[nn.Module]],
              device: torch.device | None) -> Any:
    if isinstance(value, torch.device) and value.type == "meta" and device is not None:
        return device
    if not isinstance(value, ModulePath):
        return value
    if owner_path == "" or value.path == owner_path or value.path.startswith(owner_path + "."):
        relative = value.path[len(owner_path):].lstrip(".")
        try:
            return owner.get_submodule(relative)
        except AttributeError:
            return _MISSING
    held = modules_at(value.path)
    return held[0] if held else _MISSING


def covered_by(root: nn.Module, calls: Sequence[InitCall]) -> frozenset[str]:
    """The tensors of ``root`` (still on the meta device) the calls write or replace (a buffer assigned anew, as
    torchtitan's ``init_weights`` does), found by making them on a copy of the smallest module that holds every
    module they name. A call that fails there is refused."""
    if not calls:
        return frozenset()
    paths = [call.module for call in calls] + [value.path for call in calls
                                               for value in (*call.positional, *(v for _, v in call.keywords))
                                               if isinstance(value, ModulePath)]
    top = ".".join(_common_prefix([path.split(".") if path else [] for path in paths]))
    scratch = scratch_copy(root.get_submodule(top))
    prefix = f"{top}." if top else ""
    modules_at = lambda path: [scratch.get_submodule(path[len(prefix):] if path != top else "")]  # noqa: E731
    before = {name: id(tensor) for name, _, tensor in tensor_slots(scratch)}
    keys: set[int] = set()
    for call in calls:
        try:
            with Writes(lambda tensor: keys.add(storage_key(tensor))):
                run_calls([call], modules_at)
        except Exception as error:
            raise ValueError(
                f"The model is built on the meta device (in `configure_model`) and initialises itself with"
                f" {call.describe()}, which fails there ({type(error).__name__}: {error}), so it cannot be run again"
                " on each rank's shards. HINT: make it work on any device (no `.item()`, no data-dependent branch),"
                " build the model in `__init__`, or pass `NDParallel(init_on_meta=False)`."
            ) from error
    replaced = [(name, kind) for name, (_, kind, _), tensor in tensor_slots(scratch) if before.get(name) != id(tensor)]
    parameters = [prefix + name for name, kind in replaced if kind == "_parameters"]
    if parameters:
        raise ValueError(
            f"The model is built on the meta device (in `configure_model`) and its own init replaces"
            f" {', '.join(f'`{name}`' for name in parameters)} with a new parameter, which cannot be done again once"
            " the parameter is sharded. HINT: initialise it in place (`nn.init.*`, `copy_`), build the model in"
            " `__init__`, or pass `NDParallel(init_on_meta=False)`."
        )
    return frozenset({prefix + name for name, _, tensor in tensor_slots(scratch) if storage_key(tensor) in keys}
                     | {prefix + name for name, _ in replaced})


def scratch_copy(module: nn.Module) -> nn.Module:
    """A deep copy to try things on; a LightningModule's attached Trainer (loggers, dataloaders, the strategy) is
    shared, not copied."""
    trainer = getattr(module, "_trainer", None)
    return copy.deepcopy(module, memo={id(trainer): trainer} if trainer is not None else None)


def _common_prefix(paths: list[list[str]]) -> list[str]:
    prefix = paths[0]
    for path in paths[1:]:
        length = next((i for i, (a, b) in enumerate(zip(prefix, path)) if a != b), min(len(prefix), len(path)))
        prefix = prefix[:length]
    return prefix
