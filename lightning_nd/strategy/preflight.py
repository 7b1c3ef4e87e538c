"""`Preflight`: the expected memory of a run, before the step that would run out of it.

At setup, while the model is still whole, the layouts a memory advice may point to (more tp, pp or cp, FSDP
instead of HSDP: `cost/alternatives.py`) are planned, when someone will read them (a `MemoryPlanned`
listener, or CUDA, where the check below runs). At the first training batch, when its shape is known, the
cost model prices this run and each change; rank 0 logs the expected peak, every listener hears
`MemoryPlanned`, and on CUDA a peak above the device's memory is a warning (rank 0) naming the first change that
fits, in the order of `memory_changes`, before the step that would fail. Nothing here stops a run: a failure is
logged and training goes on.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import asdict, replace
from typing import Any

import torch
from lightning.pytorch import Trainer
from torch import nn
from torch.optim import Optimizer

from lightning_nd.cost.alternatives import Change, memory_changes, price
from lightning_nd.cost.layout_cost import cost_layout
from lightning_nd.cost.memory import RankMemory
from lightning_nd.cost.shape import ModelShape, Workload, model_shape
from lightning_nd.layout.describe import human_bytes
from lightning_nd.layout.options import ParallelConfig
from lightning_nd.layout.plan import plan_layout
from lightning_nd.layout.record import Layout
from lightning_nd.mesh.dims import ParallelDims
from lightning_nd.model.batch import token_shape
from lightning_nd.strategy.events import EventBus, MemoryPlanned
from lightning_nd.strategy.quiet import first_time

log = logging.getLogger("lightning_nd")

OPTIMIZERS = {"AdamW": "adamw", "Adam": "adam", "Adagrad": "adagrad", "RMSprop": "rmsprop"}


class Preflight:
    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self._planned: dict[tuple[tuple[str, int], ...], Layout] = {}
        self._shape: ModelShape | None = None
        self._done = False

    @property
    def shape(self) -> ModelShape | None:
        """The whole model's shape, read at setup (None when the cost model cannot read it)."""
        return self._shape

    def layout_ready(self, model: nn.Module, layout: Layout, config: ParallelConfig, local_world_size: int,
                     rank: int) -> None:
        """Read the model's shape and plan the other layouts a change of dims would make, while the model is
        whole (the composer has not split it into stages and shards yet). A diagnostic: it never stops the run."""
        self._done, self._planned, self._shape = False, {}, None
        try:
            self._shape = model_shape(model, layout.options.block_classes)
            # Priced by a listener on every rank; else only for rank 0's warning on CUDA.
            if self.bus.wants(MemoryPlanned) or (torch.cuda.is_available() and rank == 0):
                self._plan_alternatives(model, layout, config, local_world_size)
        except Exception as error:  # noqa: BLE001 - a model the cost model cannot read still trains
            skipped = f"lightning-nd pre-flight skipped: {error}"
            (log.warning if rank == 0 and first_time(skipped) else log.debug)(skipped)

    def _plan_alternatives(self, model: nn.Module, layout: Layout, given: ParallelConfig,
                           local_world_size: int) -> None:
        level = log.level
        for change in memory_changes(layout, Workload(seq_len=1, batch=1)):
            if change.sizes is None or change.sizes["tp"] * change.sizes["cp"] > local_world_size:
                continue  # tp and cp stay inside a node
            try:
                log.setLevel(logging.ERROR)  # the alternatives' planning notes are not this run's
                config = replace(given, **change.options)
                dims = ParallelDims(**change.sizes, world_size=layout.dims["world_size"])
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self._planned[_key(change.sizes)] = plan_layout(model, dims, config,
                                                                    precision=layout.options.precision)
            except (ValueError, TypeError) as error:  # not a valid layout for this model
                log.debug("lightning-nd pre-flight: %s is not an option: %s", change.action, error)
            finally:
                log.setLevel(level)

    def _planned_layout(self, sizes: dict[str, int], options: dict[str, Any]) -> Layout:
        if _key(sizes) not in self._planned:
            raise ValueError(f"{sizes} was not a valid layout for this model")
        return self._planned[_key(sizes)]

    def first_batch(self, batch: Any, trainer: Trainer, layout: Layout | None, rank: int, device: torch.device) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._price(batch, trainer, layout, rank, device)
        except Exception as error:  # noqa: BLE001 - a diagnostic must not stop the run
            log.warning("lightning-nd pre-flight failed (the run goes on): %r", error)

    def _price(self, batch: Any, trainer: Trainer, layout: Layout | None, rank: int, device: torch.device) -> None:
        tokens, shape = token_shape(batch), self._shape
        if tokens is None or shape is None or layout is None:
            return
        workload = Workload(seq_len=tokens[1], batch=tokens[0], accumulation=trainer.accumulate_grad_batches,
                            precision=str(trainer.precision))
        optimizer = optimizer_name(trainer.optimizers[0]) if trainer.optimizers else "adamw"
        cost = cost_layout(layout, shape, workload, optimizer=optimizer)
        mine, peak = cost.ranks[rank], cost.peak
        log.info(f"lightning-nd pre-flight: expected peak {human_bytes(peak.peak_bytes)} on rank {peak.rank}"
                 f" (parameters {human_bytes(peak.params_bytes)}, gradients {human_bytes(peak.grads_bytes)},"
                 f" optimizer {human_bytes(peak.optimizer_bytes)}, activations {human_bytes(peak.activations_bytes)})"
                 f" for batches of {tokens[0]} x {tokens[1]} tokens")
        capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        listened = self.bus.wants(MemoryPlanned)
        priced = price(layout, memory_changes(layout, workload), shape, workload, self._planned_layout,
                       optimizer=optimizer) if listened or (capacity is not None and rank == 0) else []
        if capacity is not None and peak.peak_bytes > capacity and rank == 0:
            warnings.warn(_over_capacity(peak.peak_bytes, capacity, priced), stacklevel=2)
        if listened:
            alternatives = tuple({**asdict(change), "peak_bytes": memory.peak_bytes, "batch": trial.batch,
                                  "accumulation": trial.accumulation} for change, memory, trial in priced)
            self.bus.emit(MemoryPlanned(rank, mine.to_dict(), peak.to_dict(), asdict(workload),
                                               optimizer, alternatives, capacity))


def optimizer_name(optimizer: Optimizer) -> str:
    """The cost model's name for a torch optimizer (Lightning may wrap it); AdamW's accounting when unknown."""
    inner: Optimizer = getattr(optimizer, "optimizer", optimizer)
    name = type(inner).__name__
    if name == "SGD":
        return "sgd_momentum" if any(g.get("momentum", 0) for g in inner.param_groups) else "sgd"
    return OPTIMIZERS.get(name, "adamw")


def _key(sizes: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(sizes.items()))


def _over_capacity(peak: int, capacity: int, priced: list[tuple[Change, RankMemory, Workload]]) -> str:
    """The warning; its HINT is the first change that fits, in `memory_changes`' order (the least disruptive
    first: recomputation, then sharding, then splitting the model)."""
    fitting = [(memory.peak_bytes, change.action) for change, memory, _ in priced if memory.peak_bytes <= capacity]
    advice = (f" HINT: {fitting[0][1]} is expected to peak at {human_bytes(fitting[0][0])}." if fitting else
              " HINT: none of the usual changes fits alone; plan with `python -m lightning_nd.plan --gpu-memory ...`.")
    return (f"lightning-nd pre-flight: the expected peak {human_bytes(peak)} exceeds this GPU's"
            f" {human_bytes(capacity)}: the first steps will likely run out of memory.{advice}")
