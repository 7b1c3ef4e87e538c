"""`NDParallel`: the Lightning glue. Each hook reads top to bottom and calls the collaborators it owns: the plan
(`layout/plan.py`, made once at ``connect``), the composer (`parallel/compose.py`), the pipeline engine, the
checkpointer, the failure monitor, the pre-flight and the event bus (`events.py`). This file: construction, the
plan, the processes, the model's setup, checkpoints and failures; every step's hooks: `step_hooks.py`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_nd.layout.arguments import check_keywords, read_arguments
from lightning_nd.layout.dims import ParallelDims
from lightning_nd.layout.plan import plan_layout
from lightning_nd.layout.record import Layout
from lightning_nd.layout.validate import check_config
from lightning_nd.parallel.compose import ParallelizeReport
from lightning_nd.runtime.materialize import materialize
from lightning_nd.runtime.mesh import NDMesh, build_mesh
from lightning_nd.runtime.probe import already_parallel, model_to_check
from lightning_nd.runtime.timeouts import DEFAULTS as TIMEOUTS
from lightning_nd.runtime.timeouts import check_timeouts
from lightning_nd.strategy import lifecycle
from lightning_nd.strategy.checkpointer import Checkpointer
from lightning_nd.strategy.events import EventBus
from lightning_nd.strategy.failure_monitor import FailureMonitor
from lightning_nd.strategy.pipeline_engine import PipelineEngine
from lightning_nd.strategy.preflight import Preflight
from lightning_nd.strategy.step_events import StepEvents
from lightning_nd.strategy.step_hooks import StepHooks

log = logging.getLogger("lightning_nd")


class NDParallel(StepHooks):
    """N-D parallel training of an ordinary LightningModule (every knob: the README's "Knobs").

    ``dp_replicate, dp_shard, cp, tp, pp, ep``: the dim sizes (`ParallelDims`; ``dp_shard=-1`` fills the world);
    the keywords after them: how to parallelize (`ParallelConfig`), ``init_on_meta`` (build `configure_model`'s
    layers on meta, materialise each rank's shards), the three timeouts (`runtime/timeouts.py`,
    `failure_monitor.py`) and ``process_group_backend`` (chosen from the device when None).
    After ``connect``, ``strategy.layout`` is the run's `Layout`; ``strategy.config`` stays what was passed.
    """

    strategy_name = "nd"

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        *,
        zero_stage: Literal[1, 2, 3] | None = None,
        tp_plan: Mapping[str, object] | None = None,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        block_classes: Sequence[type | str] | None = None,
        activation_checkpointing: Literal["none", "full", "selective"] = "none",
        compile: bool | str = False,
        cpu_offload: bool = False,
        pp_schedule: str = "1f1b",
        pp_microbatches: int | None = None,
        pp_stages_per_rank: int | None = None,
        pp_layers_per_stage: Sequence[int] | None = None,
        pp_split: Sequence[str] | None = None,
        cp_shard_keys: Sequence[str] | None = None,
        cp_positions: Literal["position_ids", "model"] = "position_ids",
        init_on_meta: bool = True,
        timeout: timedelta | float = TIMEOUTS["timeout"],
        init_timeout: timedelta | float = TIMEOUTS["init_timeout"],
        heartbeat_timeout: timedelta | float | None = TIMEOUTS["heartbeat_timeout"],
        process_group_backend: str | None = None,
    ) -> None:
        timeout, init_timeout, heartbeat_timeout = check_timeouts(timeout, init_timeout, heartbeat_timeout)
        super().__init__(save_distributed_checkpoint=True, process_group_backend=process_group_backend,
                         timeout=init_timeout)
        arguments = read_arguments(
            {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp, "pp": pp, "ep": ep},
            {"zero_stage": zero_stage, "tp_plan": tp_plan, "sequence_parallel": sequence_parallel,
             "loss_parallel": loss_parallel, "block_classes": block_classes,
             "activation_checkpointing": activation_checkpointing, "compile": compile, "cpu_offload": cpu_offload,
             "pp_schedule": pp_schedule, "pp_microbatches": pp_microbatches, "pp_stages_per_rank": pp_stages_per_rank,
             "pp_layers_per_stage": pp_layers_per_stage, "pp_split": pp_split, "cp_shard_keys": cp_shard_keys,
             "cp_positions": cp_positions})
        self._sizes, self.config = arguments.sizes, arguments.config
        self._init_on_meta = init_on_meta
        self._cp_positions: Tensor | None = None
        self._dims: ParallelDims | None = None
        self._nd_mesh: NDMesh | None = None
        self._layout: Layout | None = None
        self._planned_on: list[tuple[str, tuple[int, ...]]] | None = None
        self.report: ParallelizeReport | None = None
        self.events = EventBus(self)
        self.step_events = StepEvents(self.events)
        self.checkpointer, self.preflight = Checkpointer(self), Preflight()
        self.failures = FailureMonitor(timeout, init_timeout, heartbeat_timeout, barrier=self.barrier,
                                       resume_hint=self._resume_hint,
                                       on_verdict=lambda *verdict: lifecycle.deliver_verdict(self, *verdict))
        self.pipeline: PipelineEngine | None = None

    @classmethod
    def from_config(cls, options: Mapping[str, Any]) -> NDParallel:
        """Build from a mapping (a Hydra ``parallel`` group); an unknown key names the closest valid one."""
        check_keywords(options)
        return cls(**options)

    # ---- what the run is ------------------------------------------------------------------------

    @property
    def dims(self) -> ParallelDims:
        if self._dims is None:
            raise RuntimeError("`NDParallel.dims` is known once the Trainer has set the number of devices.")
        return self._dims

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            raise RuntimeError("`NDParallel.layout` is made when fit/validate/test/predict starts (at `connect`, or"
                               " at `setup` for a `configure_model` that needs the device mesh).")
        return self._layout

    @property
    def layout_or_none(self) -> Layout | None:
        return self._layout

    @property
    @override
    def device_mesh(self) -> NDMesh:
        if self._nd_mesh is None:
            raise RuntimeError("The device mesh exists once the processes have started (in `configure_model` and later).")
        return self._nd_mesh

    @property
    def pipeline_timings(self) -> dict[str, float]:
        """Last step on this rank: ``step_s``, ``compute_s`` (forward/backward), ``idle_s``, ``idle_fraction``."""
        return self.pipeline.timings if self.pipeline is not None else {}

    @override
    def _configure_launcher(self) -> None:
        # The Trainer knows devices x nodes here, before any process is launched: validate now.
        self._dims = ParallelDims(**self._sizes, world_size=self.num_nodes * self.num_processes)
        check_config(self._dims.as_dict(), self.config)
        super()._configure_launcher()

    @override
    def connect(self, model: LightningModule) -> None:
        super().connect(model)
        if self.report is not None and self.report.module is model:
            return  # validate/test/predict after fit: planned and parallelized already
        probe = model_to_check(model)
        self._layout = self._plan(probe) if probe is not None else None
        # A copy built by `configure_model` before `setup()` ran may differ from the real model: checked in setup.
        self._planned_on = _parameter_shapes(probe) if probe is not None and probe is not model else None

    def _plan(self, module: torch.nn.Module) -> Layout:
        """The Layout; its warnings are said once, by rank 0 (every rank plans the same)."""
        quiet = self.global_rank != 0
        level = log.level
        with warnings.catch_warnings():
            if quiet:
                warnings.simplefilter("ignore")
                log.setLevel(logging.ERROR)
            try:
                return plan_layout(module, self.dims, self.config, local_world_size=self.num_processes,
                                   precision=getattr(self.precision_plugin, "precision", None))
            finally:
                log.setLevel(level)

    @override
    def setup_environment(self) -> None:
        lifecycle.start_processes(self)
        self._nd_mesh = build_mesh(self.dims, self.root_device.type)
        lifecycle.groups_created(self)
        self.failures.start()
        self.step_events.attach(self.root_device, lambda: self.lightning_module.trainer.global_step)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._nd_mesh
        rank_zero_info(f"lightning-nd mesh {self.dims.as_dict()}\n{self.dims.rank_table()}")

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Only ranks on different batch coordinates get different samples: tp ranks share a batch.
        return {"num_replicas": self.device_mesh.size("batch"), "rank": self.device_mesh.local_rank("batch")}

    # ---- model setup -----------------------------------------------------------------------------

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        meta = self._init_on_meta if empty_init is None else empty_init
        with torch.device("meta") if meta else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        if self.report is not None and self.report.module is self.model:
            pass  # a later stage (validate/test/predict after fit) on the module already parallelized
        elif already_parallel(self.model):
            rank_zero_info("lightning-nd: `configure_model` parallelized the model itself; the composer is skipped.")
        else:
            if self._layout is None or (self._planned_on is not None and self._planned_on != _parameter_shapes(self.model)):
                # `configure_model` needed the mesh, or built another model than on the copy: plan the real one
                self._layout = self._plan(self.model)
            lifecycle.layout_ready(self, trainer)
            self.report = lifecycle.parallelize_model(self)
        # With CPU offload FSDP keeps the shards in host memory and moves them itself.
        device = torch.device("cpu") if self.config.cpu_offload else self.root_device
        # Ranks that hold the same shard must draw the same numbers: one seed for all, from rank 0.
        materialize(self.model, device, seed=self.broadcast(torch.initial_seed() % 2**31))
        if not self.config.cpu_offload:
            self.model_to_device()
        if self.report is not None and self.report.stages and (self.pipeline is None or self.pipeline.report is not self.report):
            self.pipeline = PipelineEngine(self, self.report, self.layout, self.device_mesh.group("pp"),
                                           self.root_device, self.step_events.report("pp"))
        self.step_events.watch_routing(self.model)
        lifecycle.sync_metrics_over_batch_ranks(self)
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, device)
        self.step_events.start_waiting()

    # ---- checkpoints and failures ----------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.checkpointer.model_state()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self.checkpointer.optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("`NDParallel.save_checkpoint(..., storage_options=...)` is not supported: it writes with"
                            " torch.distributed.checkpoint, not a `CheckpointIO` plugin.")
        self.checkpointer.save(checkpoint, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self.checkpointer.load(checkpoint_path, weights_only)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        return self.checkpointer.resumed_loader(super().process_dataloader(dataloader))

    def _resume_hint(self) -> str:
        last = self.checkpointer.last_checkpoint
        return f" HINT: resume with `Trainer.fit(..., ckpt_path={str(last)!r})`." if last else ""

    @override
    def on_exception(self, exception: BaseException) -> None:
        lifecycle.out_of_memory(self, exception)
        self.failures.on_exception(exception)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self.failures.teardown()
        super().teardown()


def _parameter_shapes(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(param.shape)) for name, param in module.named_parameters()]

