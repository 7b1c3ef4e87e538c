"""The module's own ``training_step`` / ``validation_step`` / ``test_step`` under pipeline parallelism.

A stage cannot run the whole model, so a step runs in two parts:

1. Capture (every rank): the step is called with the whole batch and the pipelined model replaced by a
   stand-in that records the call (its positional and keyword inputs) and stops the step there. These are
   the pipeline's inputs: the schedule splits them into microbatches and feeds them to every stage.
2. Score (the rank holding the last stage, once per microbatch): the step is called again with that
   microbatch's slice of the batch, and its call of the model returns what the model returned for the
   microbatch on the last stage (a Hugging Face model given ``labels`` returns its own ``loss``). The loss
   the step returns is the microbatch's; backward runs through the schedule.

What the step logs on the last stage is combined over the microbatches by its ``reduce_fx`` (mean, sum,
max or min; evaluation weighs the mean by microbatch size), handed to every rank of the pipeline and
logged there, so rank 0 (the loggers, on the first stage), ``ModelCheckpoint(monitor=...)`` and early
stopping see one value per step, as without pp. Code before the model call runs once more per microbatch
on the last stage: keep side effects (counters, metric updates) in callbacks or ``on_train_batch_end``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from lightning_nd.nn.moe import aux_losses_added_by_pipeline
from lightning_nd.pipeline_parallel.runner import full_value
from lightning_nd.pipeline_parallel.stage import pack_inputs

REDUCTIONS = {"mean": "mean", "sum": "sum", "max": "max", "min": "min"}
CAPTURE = object()


class _Captured(BaseException):
    """Stops a step at its model call (a BaseException, so a step's own ``except Exception`` does not swallow it)."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.call = (args, kwargs)


class _ModelCall(nn.Module):
    """Stands in for the pipelined model inside a step: records the call, or returns the last stage's output."""

    def __init__(self, stages: nn.Module, output: Any) -> None:
        super().__init__()
        self.stages = stages  # so that `self.parameters()` inside the step still sees this rank's weights
        self.output, self.calls = output, 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.output is CAPTURE:
            raise _Captured(args, kwargs)
        self.calls += 1
        return self.output


@contextmanager
def _standing_in(module: nn.Module, attribute: str, output: Any) -> Iterator[_ModelCall]:
    real = module._modules[attribute]
    assert real is not None, f"the pipelined model is `{attribute}`"
    stand_in = _ModelCall(real, output)
    module._modules[attribute] = stand_in
    try:
        yield stand_in
    finally:
        module._modules[attribute] = real


def call_inputs(args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A model call as the keyword inputs every stage receives (``_arg0``, ``_arg1``... for positional ones)."""
    return {**pack_inputs(args), **kwargs}


def capture(module: nn.Module, attribute: str, step: Callable[..., Any], args: tuple) -> dict[str, Any] | None:
    """The inputs the step calls the model with, or None when it returns without calling it (a skipped step)."""
    with _standing_in(module, attribute, CAPTURE), _logging_to(module, _Discard()):
        try:
            step(*args)
        except _Captured as captured:
            return call_inputs(*captured.call)
    return None


def batch_size(inputs: Mapping[str, Any]) -> int:
    sizes = [value.shape[0] for value in inputs.values() if isinstance(value, Tensor) and value.ndim]
    if not sizes:
        raise ValueError("Under pipeline parallelism the model's call must have a tensor input with a batch dimension;"
                         f" the step called it with {', '.join(inputs) or 'nothing'}.")
    return sizes[0]


def microbatch(batch: Any, index: int, count: int, size: int) -> Any:
    """Microbatch ``index`` of ``count`` of a batch: every tensor with ``size`` rows split as the schedule splits."""
    if isinstance(batch, Tensor):
        return torch.tensor_split(batch, count)[index] if batch.ndim and batch.shape[0] == size else batch
    if isinstance(batch, Mapping):
        parts = {key: microbatch(value, index, count, size) for key, value in batch.items()}
        try:
            return cast(Any, type(batch))(parts)
        except TypeError:
            return parts
    if isinstance(batch, (list, tuple)):
        pieces = [microbatch(value, index, count, size) for value in batch]
        return type(batch)(*pieces) if hasattr(batch, "_fields") else type(batch)(pieces)
    return batch


def score(module: nn.Module, attribute: str, step: Callable[..., Any], args: tuple, output: Any,
          logged: Logged) -> tuple[Any, bool]:
    """Run the step on one microbatch (``args[0]``) with its model call answered by ``output``; returns what it
    returned and whether it asked for the MoE auxiliary losses (which the stages add themselves)."""
    with _standing_in(module, attribute, output) as stand_in, _logging_to(module, logged), \
            aux_losses_added_by_pipeline() as asked:
        result = step(*args)
    if stand_in.calls != 1:
        raise ValueError(
            f"`{type(module).__name__}.{step.__name__}` called the model {stand_in.calls} times in one step; under"
            " pipeline parallelism a step calls it once. HINT: call the model once, or define `pipeline_inputs(batch)`"
            " and `pipeline_loss(output, target)` to say what the pipeline runs and scores."
        )
    return result, bool(asked)


def step_loss(result: Any, module: nn.Module, step: str) -> Tensor:
    loss = result.get("loss") if isinstance(result, Mapping) else result
    if not isinstance(loss, Tensor):
        raise ValueError(f"`{type(module).__name__}.{step}` returned {type(result).__name__} for a microbatch; under"
                         " pipeline parallelism every microbatch needs its loss. HINT: return the loss tensor (or"
                         " {'loss': loss}); a step cannot be skipped by returning None under pp.")
    return loss


@contextmanager
def _logging_to(module: nn.Module, sink: Callable[..., None]) -> Iterator[None]:
    vars(module)["log"] = sink  # an instance attribute shadows `LightningModule.log` (and `log_dict`, which calls it)
    try:
        yield
    finally:
        del vars(module)["log"]


class _Discard:
    def __call__(self, name: str, value: Any, **options: Any) -> None:
        pass


class Logged:
    """What a step logs on the last stage, microbatch by microbatch, with each microbatch's weight."""

    def __init__(self) -> None:
        self.values: dict[str, list[tuple[float, float]]] = {}
        self.options: dict[str, dict[str, Any]] = {}
        self.weight = 1.0

    def __call__(self, name: str, value: Any, **options: Any) -> None:
        if hasattr(value, "compute") and hasattr(value, "update"):
            raise ValueError(f"`self.log({name!r}, <{type(value).__name__}>)`: under pipeline parallelism only the last"
                             " stage runs the step's loss part, so a metric object would be updated there alone."
                             " HINT: log a tensor (`metric(...)`'s value), or update the metric in a callback.")
        value = full_value(value)
        number = float(value.detach().float().item()) if isinstance(value, Tensor) else float(value)
        self.values.setdefault(name, []).append((number, self.weight))
        self.options[name] = options

    def combined(self) -> list[tuple[str, float, dict[str, Any]]]:
        return [(name, _combine(pairs, self.options[name].get("reduce_fx", "mean"), name), self.options[name])
                for name, pairs in self.values.items()]


def _combine(pairs: list[tuple[float, float]], reduce_fx: Any, name: str) -> float:
    kind = REDUCTIONS.get(reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", ""))
    values = [value for value, _ in pairs]
    if kind == "mean":
        return sum(value * weight for value, weight in pairs) / sum(weight for _, weight in pairs)
    if kind == "sum":
        return sum(values)
    if kind in ("max", "min"):
        return max(values) if kind == "max" else min(values)
    raise ValueError(f"`self.log({name!r}, ..., reduce_fx={reduce_fx!r})`: under pipeline parallelism a step's"
                     " microbatch values are combined by 'mean', 'sum', 'max' or 'min'. HINT: use one of those.")


def plus(loss: Tensor, aux: Tensor | None) -> Tensor:
    """The microbatch loss with the last stage's MoE auxiliary losses (a plain tensor, also beside a DTensor loss)."""
    if aux is None:
        return loss
    if isinstance(loss, DTensor):
        aux = DTensor.from_local(aux, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False)
    return loss + aux


def share(payload: Any, src: int, group: dist.ProcessGroup) -> Any:
    """``payload`` from the rank holding the last stage, on every rank of the pipeline."""
    holder = [payload]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]


def replay(module: Any, logged: list[tuple[str, float, dict[str, Any]]], device: torch.device) -> None:
    """Log the combined values on this rank, with the step's own options."""
    for name, value, options in logged:
        module.log(name, torch.tensor(value, device=device), **options)
