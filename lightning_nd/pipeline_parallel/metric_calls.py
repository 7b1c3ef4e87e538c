"""torchmetrics objects inside a step under pipeline parallelism.

Under pp a step runs on the rank holding the last stage once per microbatch (`own_steps.py`); one process calls its
metrics once per batch. So inside the step every call of the module's metrics (``metric(preds, target)``,
``metric.update(...)``, a ``MetricCollection``'s) is recorded, not run. After the microbatches the calls are joined into
the batch's (`batch_join.py`: tensor arguments concatenated along dim 0), handed to every rank of the pipeline and run
there once, in the step's order. Every rank's metric then holds what one process's holds, its step value included
(``dist_sync_on_step`` syncs over the batch ranks, each rank of the pipeline with its own), and ``compute()`` reads the
same on every rank, so rank 0 (on the first stage) logs what one process logs.

A metric's forward inside the step returns its value on that microbatch, computed on a copy of the metric that never
syncs. The arguments travel to every stage once per step: pass a metric predictions (``logits.argmax(-1)``) rather than
a sequence's logits.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_nd.pipeline_parallel.batch_join import NotJoinable, join_microbatches, map_tensors

METHODS = ("forward", "update")


@dataclass(frozen=True)
class MetricCall:
    """One call of a metric of the module: its name there (``val_acc.0``), the method, the arguments."""

    metric: str
    method: str
    args: tuple
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class MetricRef:
    """A metric object a step logged, by its name in the module (logged again on every rank)."""

    metric: str


def metrics_of(module: nn.Module) -> dict[str, Any]:
    """The module's torchmetrics objects (metrics and collections) by name."""
    try:
        from torchmetrics import Metric, MetricCollection
    except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
        return {}
    return {name: child for name, child in module.named_modules() if isinstance(child, (Metric, MetricCollection))}


class MetricCalls:
    """Records one step's metric calls microbatch by microbatch (on the last stage) and joins them."""

    def __init__(self) -> None:
        self._copies: dict[int, tuple[Any, Any]] = {}  # a metric by id -> (it, its copy for a microbatch's value)
        self._microbatches: list[list[MetricCall]] = []
        self._found: tuple[nn.Module | None, dict[str, Any]] = (None, {})

    def of(self, module: nn.Module) -> dict[str, Any]:
        """The module's metrics by name, looked up once per module (every microbatch of every step asks)."""
        if self._found[0] is not module:
            self._found = (module, metrics_of(module))
        return self._found[1]

    def start(self) -> None:
        self._microbatches = []

    @contextmanager
    def recording(self, module: nn.Module) -> Iterator[None]:
        """One microbatch of the step: its metric calls recorded; a forward returns its value on the microbatch."""
        calls: list[MetricCall] = []
        self._microbatches.append(calls)
        with self._patched(module, calls.append):
            yield

    @contextmanager
    def discarding(self, module: nn.Module) -> Iterator[None]:
        """The step run to capture the model's inputs: a metric call before the model's changes nothing."""
        with self._patched(module, lambda call: None):
            yield

    def joined(self, step: str) -> list[MetricCall]:
        """The batch's calls: the microbatches' joined call by call (``step`` names the step in an error)."""
        recorded, self._microbatches = self._microbatches, []
        if not recorded or not recorded[0]:
            return []
        shape = [(call.metric, call.method, len(call.args), sorted(call.kwargs)) for call in recorded[0]]
        for calls in recorded[1:]:
            if [(call.metric, call.method, len(call.args), sorted(call.kwargs)) for call in calls] != shape:
                raise ValueError(
                    f"`{step}` called its metrics differently on the microbatches of one batch ({_names(recorded[0])}"
                    f" against {_names(calls)}); under pipeline parallelism those calls are joined into the batch's."
                    " HINT: call each metric the same way for every sample of a batch."
                )
        joined = []
        for index, first in enumerate(recorded[0]):
            parts = [calls[index] for calls in recorded]
            try:
                args = tuple(join_microbatches([part.args[i] for part in parts], f"its argument {i + 1}")
                             for i in range(len(first.args)))
                kwargs = {key: join_microbatches([part.kwargs[key] for part in parts], f"its argument `{key}`")
                          for key in first.kwargs}
            except NotJoinable as error:
                raise ValueError(
                    f"`{step}` called `{first.metric}.{first.method}` with a value the microbatches cannot join,"
                    f" {error}. Under pipeline parallelism the step runs once per microbatch and its metric"
                    " calls are joined into the batch's, as one process makes them. HINT: pass the metric per-sample"
                    " values (e.g. `F.cross_entropy(..., reduction='none')` instead of the mean), or log a scalar with"
                    " `self.log(...)`, which combines it over the microbatches."
                ) from None
            joined.append(MetricCall(first.metric, first.method, args, kwargs))
        return joined

    @contextmanager
    def _patched(self, module: nn.Module, keep: Callable[[MetricCall], None]) -> Iterator[None]:
        with ExitStack() as stack:
            for name, metric in self.of(module).items():
                scratch = self._scratch(metric)
                for method in METHODS:
                    stack.enter_context(_replaced(metric, method, _recorder(name, method, keep, scratch)))
            yield

    def _scratch(self, metric: Any) -> Any:
        kept = self._copies.get(id(metric))
        if kept is None or kept[0] is not metric:
            groups = {id(child.process_group): child.process_group for child in metric.modules()
                      if getattr(child, "process_group", None) is not None}
            scratch = copy.deepcopy(metric, groups)
            for child in scratch.modules():
                if hasattr(child, "distributed_available_fn"):
                    child.distributed_available_fn = _never_distributed
            kept = self._copies[id(metric)] = (metric, scratch)
        return kept[1]


def _never_distributed() -> bool:
    return False


def _recorder(name: str, method: str, keep: Callable[[MetricCall], None], scratch: Any) -> Callable[..., Any]:
    def record(*args: Any, **kwargs: Any) -> Any:
        keep(MetricCall(name, method, _detached(args), _detached(kwargs)))
        if method == "update":
            return None
        scratch.reset()
        return scratch(*args, **kwargs)

    return record


@contextmanager
def _replaced(metric: nn.Module, method: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """An instance attribute shadows the class's method (torchmetrics keeps a wrapped ``update`` there itself)."""
    own = vars(metric)
    missing = object()
    before = own.get(method, missing)
    own[method] = replacement
    try:
        yield
    finally:
        if before is missing:
            del own[method]
        else:
            own[method] = before


def _detached(value: Any) -> Any:
    """Tensors detached and whole (a DTensor's full value), on the CPU for the trip to every stage."""
    return map_tensors(value, lambda tensor: (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor)
                       .detach().cpu())


def _names(calls: list[MetricCall]) -> str:
    return ", ".join(f"{call.metric}.{call.method}" for call in calls) or "no call"


def replay_calls(metrics: dict[str, Any], calls: list[MetricCall], device: torch.device) -> None:
    """Run the batch's calls of ``metrics`` (a module's, by name) on this rank, in order."""
    for call in calls:
        metric = metrics[call.metric]
        args, kwargs = map_tensors((call.args, call.kwargs), lambda tensor: tensor.to(device))
        metric(*args, **kwargs) if call.method == "forward" else metric.update(*args, **kwargs)
