"""What building a model on the meta device did that materialising it must do again, recorded while it is built.

On the meta device a tensor holds no values, so whatever a constructor or `configure_model` initialised is lost.
Materialising (`materialize.py`) gives every tensor its module's ``reset_parameters()``, then replays the model's
own init entry points. `InitRecorder`, entered around the build, records:

- the entry points plain construction ran: the outermost calls of ``init_weights``, ``_init_weights``,
  ``reset_parameters``, ``_reset_parameters`` or ``post_init`` on a module of the model, with their arguments (a
  module's own ``reset_parameters`` called by its own constructor is not one: every module's is run anyway, also
  one set on the module object);
- every in-place write to a parameter or buffer after its module was constructed, outside that module's
  ``reset_parameters`` (``nn.init.*``, ``normal_``, ``zero_``, ``copy_``...), and whether an entry point made it;
- every parameter or buffer registered on a module after the module was constructed (a tie to an existing tensor
  is not one), and which module created each tensor (a shared tensor takes its creator's ``reset_parameters``);
- the tensors made as constants and only filled with constants since (`init_constants.py`), with their values.

`resolve` turns this into a `ModelInit` (`model_init.py`) of names and paths, valid for any copy of the model.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from lightning_nd.runtime.init_constants import UNKNOWN, made_constant, refilled
from lightning_nd.runtime.model_init import (
    ENTRY_METHODS,
    InitCall,
    Lost,
    ModelInit,
    ModulePath,
    Writes,
    covered_by,
    storage_key,
)
from lightning_nd.runtime.ties import shared_tensors, tensor_slots

_LIBRARIES = tuple(str(Path(str(module.__file__)).parent) + os.sep for module in (torch, sys.modules["lightning_nd"]))


class InitRecorder:
    """A context manager recording how a model is built (enter it around construction on the meta device)."""

    def __init__(self) -> None:
        self._calls: list[tuple[nn.Module, str, tuple[Any, ...], tuple[tuple[str, Any], ...]]] = []
        self._creators: dict[int, nn.Module] = {}  # every tensor registered, by id: the module it was registered on
        self._writes: list[tuple[int, frozenset[int], str | None, str]] = []  # see `_written`
        self._alive: list[object] = []  # what the ids and storage keys above name, kept alive so they stay unique
        self._swapped: list[tuple[int, str]] = []  # tensor id, where
        self._constants: dict[int, bool | int | float] = {}  # storage key -> the one value it holds
        self._owners: dict[int, nn.Module] = {}  # storage key -> the module that registered it
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> InitRecorder:
        hooks = [register_module_parameter_registration_hook(self._registered),
                 register_module_buffer_registration_hook(self._registered)]
        mode = Writes(self._written, self._result)
        mode.__enter__()
        previous = sys.getprofile()
        sys.setprofile(self._profile(previous))
        self._undo = [lambda: sys.setprofile(previous), lambda: mode.__exit__(None, None, None),
                      *(hook.remove for hook in hooks)]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for undo in self._undo:
            undo()
        self._undo = []

    # ---- while the model is built -----------------------------------------------------------------------------------

    def _registered(self, module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
        if tensor is None or id(tensor) in self._creators:
            return  # a tie to a tensor registered before
        self._alive.append(tensor)
        self._creators[id(tensor)] = module
        self._owners.setdefault(storage_key(tensor), module)
        frame = sys._getframe(1)
        if not (_constructing(module, frame) or _resetting(module, frame)):
            self._swapped.append((id(tensor), _where(sys._getframe(1))))

    def _written(self, tensor: torch.Tensor) -> None:
        building: set[int] = set()  # modules whose constructor or own reset_parameters is running
        entry = None
        start = sys._getframe(1)
        for frame in _frames(start):
            method = frame.f_code.co_name
            if method == "__init__" or method in ENTRY_METHODS:
                module = frame.f_locals.get("self")
                if isinstance(module, nn.Module):
                    if method in ("__init__", "reset_parameters"):
                        building.add(id(module))
                        self._alive.append(module)
                    if method in ENTRY_METHODS:
                        entry = f"{type(module).__name__}.{method}"
        storage = tensor.untyped_storage()
        owner = self._owners.get(storage._cdata)
        if owner is not None and _in_own_reset(owner, start):
            building.add(id(owner))
        self._alive.append(storage)
        self._writes.append((storage._cdata, frozenset(building), entry, _where(start)))
        self._constants.pop(storage._cdata, None)  # any write; `_result` gives the value back to a constant fill

    def _result(self, func: Any, args: tuple, result: Any) -> None:
        value, tensor = made_constant(func, args), result
        if value is UNKNOWN:
            value, tensor = refilled(func, args), args[0] if args else None
        if value is not UNKNOWN and isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            self._alive.append(storage)
            self._constants[storage._cdata] = value

    def _profile(self, previous: Any) -> Callable[[FrameType, str, Any], Any]:
        def profile(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "call" and frame.f_code.co_name in ENTRY_METHODS:
                self._entered(frame)
            if previous is not None:
                previous(frame, event, arg)

        return profile

    def _entered(self, frame: FrameType) -> None:
        module, method = frame.f_locals.get("self"), frame.f_code.co_name
        if not isinstance(module, nn.Module):
            return
        caller = frame.f_back
        holds = bool(module._parameters or module._buffers)
        if (method == "reset_parameters" and holds and caller is not None and caller.f_code.co_name == "__init__"
                and caller.f_locals.get("self") is module):
            return  # a module resetting its own tensors while it is built: materialising runs it for every module
        outer = caller
        while outer is not None:
            if outer.f_code.co_name in ENTRY_METHODS and isinstance(outer.f_locals.get("self"), nn.Module):
                return  # inside another entry point, which is replayed whole
            outer = outer.f_back
        positional, keywords = _arguments(frame)
        self._calls.append((module, method, positional, keywords))

    # ---- afterwards -------------------------------------------------------------------------------------------------

    def resolve(self, root: nn.Module) -> ModelInit:
        """The record in names and paths of ``root`` (the module the model was built in), its entry points tried on
        a copy of ``root`` (still on the meta device) to learn which tensors they initialise."""
        paths: dict[int, str] = {}
        for path, module in root.named_modules(remove_duplicate=False):
            paths.setdefault(id(module), path)
        names: dict[int, str] = {}
        by_id: dict[int, str] = {}
        holders: dict[int, set[int]] = {}
        for name, (module, _, _), tensor in tensor_slots(root):
            names.setdefault(storage_key(tensor), name)
            by_id.setdefault(id(tensor), name)
            holders.setdefault(storage_key(tensor), set()).add(id(module))
        calls = tuple(call for call in (_call(record, paths) for record in self._calls) if call is not None)
        covered = covered_by(root, calls)
        lost = [Lost(names[key], where) for key, building, entry, where in self._writes
                if key in names and not building & holders[key] and (entry is None or names[key] not in covered)]
        lost += [Lost(by_id[key], where) for key, where in self._swapped if key in by_id]
        creators = tuple((by_id[key], paths[id(self._creators[key])]) for key in shared_tensors(root)
                         if key in self._creators and id(self._creators[key]) in paths)
        first: dict[str, Lost] = {}
        for item in lost:
            first.setdefault(item.tensor, item)
        constants = tuple((names[key], value) for key, value in self._constants.items() if key in names)
        return ModelInit(calls, creators, covered, tuple(first.values()), constants)


def _call(record: tuple[nn.Module, str, tuple, tuple], paths: dict[int, str]) -> InitCall | None:
    """An entry-point call in paths; None when its module is not in the model or an argument cannot be given again
    (a tensor)."""
    module, method, positional, keywords = record
    if id(module) not in paths:
        return None
    values = [*positional, *(value for _, value in keywords)]
    if any(isinstance(value, torch.Tensor) for value in values):
        return None
    if any(isinstance(value, nn.Module) and id(value) not in paths for value in values):
        return None
    as_path = lambda value: ModulePath(paths[id(value)]) if isinstance(value, nn.Module) else value  # noqa: E731
    return InitCall(paths[id(module)], type(module).__name__, method, tuple(as_path(v) for v in positional),
                    tuple((key, as_path(value)) for key, value in keywords))


def _arguments(frame: FrameType) -> tuple[tuple[Any, ...], tuple[tuple[str, Any], ...]]:
    """A call's arguments besides ``self``, from its frame as it starts: positional, then keyword."""
    code, values = frame.f_code, frame.f_locals
    named = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    positional = tuple(values[name] for name in named[1:code.co_argcount])
    keywords = tuple((name, values[name]) for name in named[code.co_argcount:])
    extra = code.co_argcount + code.co_kwonlyargcount
    if code.co_flags & inspect.CO_VARARGS:
        positional += tuple(values[code.co_varnames[extra]])
        extra += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        keywords += tuple(values[code.co_varnames[extra]].items())
    return positional, keywords


def _frames(frame: FrameType | None) -> Iterator[FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


def _in_own_reset(module: nn.Module, frame: FrameType | None) -> bool:
    """A ``reset_parameters`` given to this module object (not its class: LitGPT's pretraining init sets
    ``mod.reset_parameters = partial(init_weights, mod, std=...)``) is running: materialising runs it again, as it
    runs every module's."""
    override = module.__dict__.get("reset_parameters")
    while isinstance(override, partial):
        override = override.func
    code = getattr(getattr(override, "__func__", override), "__code__", None)
    return code is not None and any(f.f_code is code for f in _frames(frame))


def _resetting(module: nn.Module, frame: FrameType | None) -> bool:
    """``module``'s own ``reset_parameters`` is running (LitGPT's ``GPT.reset_parameters`` assigns its rope cache
    anew): materialising runs it for every module."""
    return _in_own_reset(module, frame) or any(
        f.f_code.co_name == "reset_parameters" and f.f_locals.get("self") is module for f in _frames(frame))


def _constructing(module: nn.Module, frame: FrameType | None) -> bool:
    """``module``'s constructor is running (somewhere up the stack)."""
    return any(f.f_code.co_name == "__init__" and f.f_locals.get("self") is module for f in _frames(frame))


def _where(frame: FrameType | None) -> str:
    """The innermost line outside torch and lightning-nd: where the user's code did it."""
    for f in _frames(frame):
        if not f.f_code.co_filename.startswith(_LIBRARIES):
            return f"{Path(f.f_code.co_filename).name}:{f.f_lineno} in `{f.f_code.co_name}`"
    return "an unknown place"
