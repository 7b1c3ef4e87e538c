"""`RunPlan`: the run's `Layout` and what the composer made of it, for `NDParallel`.

Planned at ``connect``, on the model or on the copy `configure_model` builds for checking (`runtime/probe.py`);
planned again at ``setup`` when `configure_model` needed the mesh or built another model than that copy; then
published (``LayoutReady``, ``layout.json``), read by the pre-flight while the model is whole, applied by the
composer (`parallel/compose.py`) and announced (``LayoutApplied``). A model `configure_model` parallelized
itself is left as it is.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_nd.layout.options import ParallelConfig, resolve_options
from lightning_nd.layout.plan import plan_layout
from lightning_nd.layout.record import Layout
from lightning_nd.layout.validate import check_config
from lightning_nd.mesh.build import NDMesh
from lightning_nd.mesh.dims import ParallelDims
from lightning_nd.parallel.compose import ParallelizeReport, parallelize
from lightning_nd.parallel.fsdp import fsdp_root
from lightning_nd.runtime.probe import already_parallel, model_to_check
from lightning_nd.strategy.events import EventBus, LayoutApplied, LayoutReady
from lightning_nd.strategy.preflight import Preflight
from lightning_nd.tensor_parallel.infer.resolve import custom_styles

log = logging.getLogger("lightning_nd")

LAYOUT_FILE = "layout.json"
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


@dataclass(frozen=True)
class Placement:
    """Where this process stands: the dims, its global rank, the processes per node, the Trainer's precision."""

    dims: ParallelDims
    rank: int
    local_world_size: int
    precision: str | None


class RunPlan:
    def __init__(self, sizes: dict[str, int], config: ParallelConfig, bus: EventBus, preflight: Preflight,
                 init_on_meta: bool = True) -> None:
        """``sizes``: each dim's size as given (-1: fill the world); ``init_on_meta``: `configure_model` builds on
        the meta device (what materialising could not give again is refused at ``make``)."""
        self.sizes, self.config, self.bus, self.preflight = sizes, config, bus, preflight
        self.init_on_meta = init_on_meta
        self._dims: ParallelDims | None = None
        self.layout: Layout | None = None
        self.report: ParallelizeReport | None = None
        self._planned_on: list[tuple[str, tuple[int, ...]]] | None = None

    def set_world(self, world_size: int) -> None:
        """The Trainer knows devices x nodes, before any process is launched: the dims, validated now."""
        self._dims = ParallelDims(**self.sizes, world_size=world_size)
        check_config(self._dims.as_dict(), self.config)

    @property
    def dims(self) -> ParallelDims:
        if self._dims is None:
            raise RuntimeError("`NDParallel.dims` is known once the Trainer has set the number of devices.")
        return self._dims

    @property
    def made(self) -> Layout:
        if self.layout is None:
            raise RuntimeError("`NDParallel.layout` is made when fit/validate/test/predict starts (at `connect`, or"
                               " at `setup` for a `configure_model` that needs the device mesh).")
        return self.layout

    def applied_to(self, model: nn.Module) -> bool:
        """Whether this model is the one the composer parallelized (validate/test/predict after fit)."""
        return self.report is not None and self.report.module is model

    def zero_stage(self) -> int:
        """What FSDP shards; without a Layout (`configure_model` parallelized the model itself) the option still says
        what it means."""
        layout = self.layout
        return (layout.options if layout is not None else resolve_options(self.dims.as_dict(), self.config)).zero_stage

    def make(self, model: nn.Module, where: Placement) -> None:
        """At ``connect``: the Layout of the model, or of `configure_model`'s copy (None when neither can be
        checked before the mesh exists)."""
        probe = model_to_check(model, on_meta=self.init_on_meta)
        self.layout = self._plan(probe, where) if probe is not None else None
        # A copy built by `configure_model` before `setup()` ran may differ from the real model: checked in `apply`.
        self._planned_on = _parameter_shapes(probe) if probe is not None and probe is not model else None

    def apply(self, model: nn.Module, mesh: NDMesh, where: Placement, log_dir: str | None) -> None:
        """At ``setup``, on the real model (built by now): plan it if needed, publish, pre-flight, compose, announce."""
        if self.applied_to(model):
            return
        if already_parallel(model):
            rank_zero_info("lightning-nd: `configure_model` parallelized the model itself; the composer is skipped.")
            if self.layout is not None and self.bus.wants(LayoutApplied):
                self.bus.emit(LayoutApplied(self.layout, None, where.dims.rank_table(), None))
            return
        if self.layout is None or (self._planned_on is not None and self._planned_on != _parameter_shapes(model)):
            self.layout = self._plan(model, where)
        layout = self.layout
        if self.bus.wants(LayoutReady):
            self.bus.emit(LayoutReady(layout, model))
        self.preflight.layout_ready(model, layout, self.config, where.local_world_size, where.rank)
        if where.rank == 0 and log_dir:
            path = Path(log_dir) / LAYOUT_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(layout.to_json(indent=1))
        # FSDP2 warns when a wrapped module returns a view; the root unit returns logits that are views of the
        # head's output on every step. Only the root unit's warning is silenced.
        root_class = type(fsdp_root(model)).__name__
        warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \(FSDP{root_class}\) returned a view tensor")
        styles = custom_styles(model, self.config.tp_plan) if where.dims.tp > 1 else None
        self.report = parallelize(model, mesh, layout, forward_methods=STEP_METHODS, styles=styles)
        if self.bus.wants(LayoutApplied):
            self.bus.emit(LayoutApplied(layout, tuple(self.report.lines()), where.dims.rank_table(),
                                        self.preflight.shape))

    def _plan(self, module: nn.Module, where: Placement) -> Layout:
        """The Layout; its warnings are said once, by rank 0 (every rank plans the same)."""
        level = log.level
        with warnings.catch_warnings():
            if where.rank != 0:
                warnings.simplefilter("ignore")
                log.setLevel(logging.ERROR)
            try:
                return plan_layout(module, where.dims, self.config, local_world_size=where.local_world_size,
                                   precision=where.precision)
            finally:
                log.setLevel(level)


def _parameter_shapes(module: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(param.shape)) for name, param in module.named_parameters()]
