"""The module's own ``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step`` under pipeline parallelism.

A stage cannot run the whole model, so a step runs in two parts:

1. Capture (every rank): the step is called with the whole batch and the pipelined model replaced by a
   stand-in that records the call (its positional and keyword inputs) and stops the step there. These are
   the pipeline's inputs: the schedule splits them into microbatches and feeds them to every stage.
2. Score (the rank holding the last stage): the step is called again, its call of the model returning what the
   model returned on the last stage. Training and evaluation score each microbatch on its slice of the batch (a
   Hugging Face model given ``labels`` returns its own ``loss``; the loss the training step returns is the
   microbatch's, and backward runs through the schedule). Prediction scores once, with the model's outputs of every
   microbatch joined into the batch's (`batch_join.py`), so ``predict_step`` returns what it returns in one process.

A `StepRun` keeps what the scored step gives on the last stage: the values it logs (combined over the microbatches by
their ``reduce_fx``: mean, sum, max or min; evaluation weighs the mean by microbatch size), its metric calls
(`metric_calls.py`), the value the step hands back, or its first error. After the schedule every rank of the pipeline
gets them and logs them, or raises the error, so rank 0 (the loggers, on the first stage),
``ModelCheckpoint(monitor=...)`` and early stopping see one value per step, as without pp. Code before the model call
runs once more per microbatch on the last stage: keep side effects other than metric calls (counters) in callbacks.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from lightning_nd.nn.moe import aux_losses_added_by_pipeline
from lightning_nd.pipeline_parallel.batch_join import map_tensors
from lightning_nd.pipeline_parallel.metric_calls import MetricCalls, MetricRef, replay_calls
from lightning_nd.pipeline_parallel.runner import full_value
from lightning_nd.pipeline_parallel.stage import pack_inputs

REDUCTIONS = {"mean": "mean", "sum": "sum", "max": "max", "min": "min"}
CAPTURE = object()
T = TypeVar("T")


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


def capture(module: nn.Module, attribute: str, step: Callable[..., Any], args: tuple,
            metrics: MetricCalls | None = None) -> dict[str, Any] | None:
    """The inputs the step calls the model with, or None when it returns without calling it (a skipped step)."""
    with _standing_in(module, attribute, CAPTURE), _logging_to(module, _Discard()), \
            (metrics or MetricCalls()).discarding(module):
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


class StepRun:
    """One step of the module under pp: its scoring on the last stage and what every rank gets of it (`shared`)."""

    def __init__(self, module: nn.Module, attribute: str, step: Callable[..., Any], metrics: MetricCalls) -> None:
        self.module, self.attribute, self.step, self.metrics = module, attribute, step, metrics
        self.name = f"{type(module).__name__}.{step.__name__}"
        self.logged = Logged({id(metric): name for name, metric in metrics.of(module).items()})
        self.value: Any = None  # what the step hands back on every rank (evaluation's loss, prediction's result)
        self.error: Exception | None = None
        metrics.start()

    def score(self, args: tuple, output: Any) -> tuple[Any, bool]:
        """Run the step on ``args`` (a microbatch, or the batch) with its model call answered by ``output``; returns
        what it returned and whether it asked for the MoE auxiliary losses (which the stages add themselves)."""
        with _standing_in(self.module, self.attribute, output) as stand_in, _logging_to(self.module, self.logged), \
                self.metrics.recording(self.module), aux_losses_added_by_pipeline() as asked:
            result = self.step(*args)
        if stand_in.calls != 1:
            raise ValueError(
                f"`{self.name}` called the model {stand_in.calls} times in one step; under pipeline parallelism a step"
                " calls it once. HINT: call the model once, or define `pipeline_inputs(batch)` and"
                " `pipeline_loss(output, target)` to say what the pipeline runs and scores."
            )
        return result, bool(asked)

    def guarded(self, work: Callable[[], T], instead: Callable[[], T]) -> T:
        """``work`` on the last stage. Its first error is kept and ``instead`` returned, so the schedule runs to its
        end on every rank of the pipeline and `shared` raises the error on all of them."""
        if self.error is not None:
            return instead()
        try:
            return work()
        except Exception as error:  # noqa: BLE001 - raised on every rank by `shared`
            self.error = error
            return instead()

    def shared(self, has_last: bool, src: int, group: dist.ProcessGroup, device: torch.device) -> Any:
        """After the schedule, on every rank of the pipeline: the last stage's logs and metric calls replayed here and
        its value returned, or its error raised here."""
        payload: tuple | None = None
        if has_last:
            if self.error is None:
                try:
                    payload = ("done", self.logged.combined(), self.metrics.joined(self.name),
                               map_tensors(self.value, lambda tensor: tensor.detach().cpu()))
                except Exception as error:  # noqa: BLE001 - raised on every rank below
                    self.error = error
            if self.error is not None:
                payload = ("failed", _portable(self.error, src))
        holder = [payload]
        dist.broadcast_object_list(holder, src=src, group=group)
        assert holder[0] is not None, "the rank holding the last stage sends what the step gave"
        if holder[0][0] == "failed":
            raise self.error if self.error is not None else holder[0][1]
        _, logged, calls, value = holder[0]
        metrics = self.metrics.of(self.module)
        replay_calls(metrics, calls, device)
        for name, number, options in logged:
            shown = metrics[number.metric] if isinstance(number, MetricRef) else torch.tensor(number, device=device)
            self.module.log(name, shown, **options)  # type: ignore[operator]
        return self.value if has_last else map_tensors(value, lambda tensor: tensor.to(device))


def _portable(error: Exception, src: int) -> Exception:
    """The error as the other ranks raise it: itself where it pickles, else its text."""
    note = f"(raised on rank {src}, which holds the last pipeline stage)"
    try:
        copy = pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - an error of a type that does not pickle travels as its text
        copy = RuntimeError(f"{type(error).__name__}: {error}")
    copy.add_note(note)
    return cast(Exception, copy)


def step_loss(result: Any, step: str) -> Tensor:
    loss = result.get("loss") if isinstance(result, Mapping) else result
    if not isinstance(loss, Tensor):
        raise ValueError(f"`{step}` returned {type(result).__name__} for a microbatch; under pipeline parallelism every"
                         " microbatch needs its loss. HINT: return the loss tensor (or {'loss': loss}); a step cannot"
                         " be skipped by returning None under pp.")
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
    """What a step logs on the last stage, microbatch by microbatch, with each microbatch's weight; a metric object
    (one of ``metric_names``: the module's, by id) is kept by name and logged as itself on every rank."""

    def __init__(self, metric_names: dict[int, str] | None = None) -> None:
        self.values: dict[str, list[tuple[float, float]]] = {}
        self.metrics: dict[str, MetricRef] = {}
        self.options: dict[str, dict[str, Any]] = {}
        self.weight = 1.0
        self._metric_names = metric_names or {}

    def __call__(self, name: str, value: Any, **options: Any) -> None:
        self.options[name] = options
        if id(value) in self._metric_names:
            self.metrics[name] = MetricRef(self._metric_names[id(value)])
            return
        if hasattr(value, "compute") and hasattr(value, "update"):
            raise ValueError(f"`self.log({name!r}, <{type(value).__name__}>)`: the metric is not an attribute of the"
                             " LightningModule, so under pipeline parallelism the other stages cannot log it. HINT:"
                             " assign it in `__init__` (`self.accuracy = ...`), as Lightning asks for metrics anyway.")
        value = full_value(value)
        number = float(value.detach().float().item()) if isinstance(value, Tensor) else float(value)
        self.values.setdefault(name, []).append((number, self.weight))

    def combined(self) -> list[tuple[str, Any, dict[str, Any]]]:
        values: list[tuple[str, Any, dict[str, Any]]] = [
            (name, _combine(pairs, self.options[name].get("reduce_fx", "mean"), name), self.options[name])
            for name, pairs in self.values.items()]
        return values + [(name, ref, self.options[name]) for name, ref in self.metrics.items()]


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
