"""One forward of a model on the meta device, recording what its units and blocks are called with and return.

Where a model declares no pipeline plan, the split reads from this trace the order its forward calls its units and
what it hands each block besides the hidden states (`units.py`). The forward runs on a copy whose parameters and
buffers are meta tensors (no memory, no arithmetic; the model itself is left as it was), on one row of token ids,
with autograd on, so each recorded tensor says which weights it was computed from; and each tensor is named by how it
was made (function, arguments), so a second trace of a copy holding fewer blocks, as a stage does, tells which block
arguments change with them. A block whose code has no meta kernel (a data-dependent MoE dispatch: ``torch.nonzero``,
``.tolist()``) hands its hidden states on unchanged: the shape a block keeps.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_nd.model.structure import get_submodule, parent_name
from lightning_nd.pipeline_parallel.layer_lists import restrict_layer_lists

TRACE_TOKENS = 4
"""Length of the one row of token ids the traced forward runs on."""


class NoTrace(Exception):
    """The model's forward did not run on the meta device on token ids, or called none of its blocks."""


@dataclass
class Call:
    """One call of a unit or block: its arguments and output, and when it started and ended (counted in calls)."""

    name: str
    args: tuple
    kwargs: dict[str, Any]
    start: int
    end: int = -1
    output: Any = None
    recipes: dict[str, Hashable] = field(default_factory=dict)
    """How each argument (by position or keyword) was made, comparable between two traces of one model."""


@dataclass
class ForwardTrace:
    calls: list[Call]
    """Every call of the traced modules, in the order they started."""
    output: Any
    """What the model returned."""
    weights: dict[int, list[str]]
    """The names (all of them, ties included) of each of the copy's parameters, by ``id``."""


def main_output(output: Any) -> Tensor:
    """The tensor a model or block returns: itself, a Hugging Face output's ``.logits``, or a tuple's first."""
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)):
        return output[0]
    return output


def hidden_argument(args: tuple, kwargs: dict[str, Any], like: Tensor) -> str | None:
    """Which argument of a block call holds the hidden states (``"0"`` for the first positional one, else a keyword):
    the first positional argument, else ``hidden_states=``, else the keyword tensor shaped as ``like``."""
    if args:
        return "0"
    if "hidden_states" in kwargs:
        return "hidden_states"
    return next((k for k, v in kwargs.items() if isinstance(v, Tensor) and v.shape == like.shape), None)


def tensor_arguments(args: tuple, kwargs: dict[str, Any]) -> Iterator[tuple[str, Tensor]]:
    """Every tensor a call received, with its argument's name (the position for positional ones), lists included."""
    for key, value in [*((str(i), v) for i, v in enumerate(args)), *kwargs.items()]:
        values = value if isinstance(value, (tuple, list)) else [value]
        yield from ((key, v) for v in values if isinstance(v, Tensor))


def weights_reached(tensor: Tensor, stop: Tensor | None = None) -> list[Tensor]:
    """The parameters ``tensor`` was computed from, not counting those reached only through ``stop``."""
    if tensor is stop:
        return []
    if tensor.grad_fn is None:
        return [tensor] if tensor.requires_grad else []
    halt = stop.grad_fn if stop is not None else None
    found: list[Tensor] = []
    seen: set[Any] = set()
    todo: list[Any] = [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node is halt or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            found.append(variable)
        todo.extend(following for following, _ in node.next_functions)
    return found


def trace_forward(model: nn.Module, units: Sequence[str], blocks: Sequence[str],
                  held: Sequence[str] | None = None) -> ForwardTrace:
    """Run ``model``'s forward on a meta-device copy of it, recording every call of ``units`` and ``blocks``. With
    ``held``, the copy keeps only those blocks, as a stage does (the others leave their container, the config's
    per-layer lists are restricted to them)."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.is_floating_point())
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    try:
        meta = copy.deepcopy(model, memo)
    except Exception as error:  # an attribute deepcopy cannot copy: no trace, the caller falls back
        raise NoTrace(f"the model could not be copied ({type(error).__name__}: {error})") from error
    for module in meta.modules():  # as the composer does under pp (`parallel/compose.py`): no KV cache in training
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False  # type: ignore[union-attr]
    if held is not None:
        for name in blocks:
            if name not in held:
                del get_submodule(meta, parent_name(name))._modules[name.rsplit(".", 1)[-1]]
        restrict_layer_lists(meta, blocks, set(held))
    named = {id(tensor): name for name, tensor in [*meta.named_parameters(), *meta.named_buffers()]}
    tokens = torch.zeros(1, TRACE_TOKENS, dtype=torch.long, device="meta")
    recorder = _Recorder({**named, id(tokens): "input"})
    kept = [name for name in blocks if held is None or name in held]
    for name in [*units, *kept]:
        module = meta.get_submodule(name)
        module.register_forward_pre_hook(functools.partial(recorder.started, name), with_kwargs=True)
        module.register_forward_hook(functools.partial(recorder.ended, name))
    for name in kept:
        block = meta.get_submodule(name)
        block.forward = _passing_on(block.forward)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), torch.enable_grad(), recorder:
            output = meta(tokens)
    except Exception as error:  # any model code that needs values: no trace, the caller decides
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise NoTrace(f"{type(error).__name__}: {reason[:200]}") from error
    if not any(call.name in blocks for call in recorder.calls):
        raise NoTrace("the forward called none of the blocks")
    weights: dict[int, list[str]] = {}
    for name, param in meta.named_parameters(remove_duplicate=False):
        weights.setdefault(id(param), []).append(name)
    return ForwardTrace(recorder.calls, output, weights)


class _Recorder(TorchFunctionMode):
    """Records the calls of the traced modules, and names every tensor the forward makes by how it was made (the
    function, and the names and numbers it was given), so that two forwards compare without values."""

    def __init__(self, named: dict[int, str]) -> None:
        super().__init__()
        self.calls: list[Call] = []
        self.counter = 0
        self.names: dict[int, Hashable] = dict(named)
        self.recipes: dict[Hashable, int] = {}
        self.kept: list[Any] = []  # what was named stays alive, so no other tensor takes its id

    def name(self, value: Any) -> Hashable:
        if isinstance(value, Tensor):
            return self.names.get(id(value), "unnamed")
        if isinstance(value, (tuple, list)):
            return tuple(self.name(item) for item in value)
        if isinstance(value, dict):
            return tuple((key, self.name(item)) for key, item in value.items())
        if isinstance(value, slice):
            return ("slice", self.name(value.start), self.name(value.stop), self.name(value.step))
        if value is None or isinstance(value, (bool, int, float, complex, str, torch.dtype, torch.device)):
            return value
        return type(value).__qualname__

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        key = (getattr(func, "__qualname__", repr(func)), self.name(args), self.name(kwargs))
        recipe = self.recipes.setdefault(key, len(self.recipes))
        for index, tensor in enumerate(output if isinstance(output, (tuple, list)) else (output,)):
            if isinstance(tensor, Tensor):
                self.names[id(tensor)] = (recipe, index)
                self.kept.append(tensor)
        return output

    def started(self, name: str, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        recipes = {key: self.name(value) for key, value in [*((str(i), v) for i, v in enumerate(args)), *kwargs.items()]}
        self.calls.append(Call(name, args, dict(kwargs), self.counter, recipes=recipes))
        self.counter += 1

    def ended(self, name: str, module: nn.Module, args: tuple, output: Any) -> None:
        call = next(call for call in reversed(self.calls) if call.name == name and call.end < 0)
        call.end, call.output = self.counter, output
        self.counter += 1


def _passing_on(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A block's forward that hands its hidden states on where its code needs values the meta device lacks."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except (NotImplementedError, RuntimeError):
            if args and isinstance(args[0], Tensor):
                return args[0]
            if isinstance(kwargs.get("hidden_states"), Tensor):
                return kwargs["hidden_states"]
            raise

    return run
