"""What Lightning calls on `NDParallel`, in the order a run calls it. Each hook hands its work to a collaborator
`NDParallel.__init__` builds (`nd_parallel.py`), giving it only what that one needs (the dims, the mesh, the Layout,
the event bus, the precision plugin, a typed record): the plan and the composer (`run_plan.py`), every step's way
through cp, loss parallel and the pipeline (`steps.py`), the checkpointer, the failure monitor, the pre-flight and the
events (`events.py`, `step_events.py`, `lifecycle.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_nd.layout.options import ParallelConfig
from lightning_nd.mesh.build import NDMesh, build_mesh
from lightning_nd.mesh.dims import ParallelDims
from lightning_nd.parallel.compose import ParallelizeReport
from lightning_nd.parallel.fsdp import accumulate_without_sync
from lightning_nd.pipeline_parallel.runner import full_value
from lightning_nd.strategy import lifecycle
from lightning_nd.strategy.auto_resume import AutoResume
from lightning_nd.strategy.checkpointer import CheckpointedRun, Checkpointer
from lightning_nd.strategy.cluster_checks import check_launch
from lightning_nd.strategy.events import EventBus, FailureVerdict
from lightning_nd.strategy.failure_monitor import FailureMonitor
from lightning_nd.strategy.launcher import patient
from lightning_nd.strategy.meta_build import MetaBuild
from lightning_nd.strategy.preflight import Preflight
from lightning_nd.strategy.process_group import start_default_group
from lightning_nd.strategy.requeue import Requeue
from lightning_nd.strategy.run_plan import Placement, RunPlan
from lightning_nd.strategy.sigterm import flag_sigterm
from lightning_nd.strategy.step_events import StepEvents
from lightning_nd.strategy.steps import Steps


class LightningHooks(ModelParallelStrategy):
    """`NDParallel`'s side that Lightning calls (`NDParallel` is the one to use: it builds the collaborators)."""

    config: ParallelConfig
    meta_build: MetaBuild
    events: EventBus
    step_events: StepEvents
    steps: Steps
    preflight: Preflight
    plan: RunPlan
    failures: FailureMonitor
    checkpointer: Checkpointer
    auto_resume: AutoResume
    requeue: Requeue

    @property
    def dims(self) -> ParallelDims:
        return self.plan.dims

    @property
    def report(self) -> ParallelizeReport | None:
        """What the composer applied (None before ``setup``, or when `configure_model` parallelized the model)."""
        return self.plan.report

    @property
    @override
    def device_mesh(self) -> NDMesh:  # type: ignore[override]  # named sub-meshes (`mesh["tp"]`), not one DeviceMesh
        return self.steps.mesh

    # ---- the plan and the processes --------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        self.plan.set_world(self.num_nodes * self.num_processes)  # before any process is launched
        check_launch(self.cluster_environment, self.num_processes, self.num_nodes)
        super()._configure_launcher()
        self._launcher = patient(self._launcher, self.failures.exit_grace())  # the ranks report before it kills them

    @override
    def connect(self, model: LightningModule) -> None:
        super().connect(model)
        if not self.plan.applied_to(model):  # validate/test/predict after fit: planned and parallelized already
            self.plan.make(model, self._placement())

    @override
    def _setup_distributed(self) -> None:
        # As Lightning's, but on this restart round's keys of the launcher's store (`process_group.py`).
        super(ModelParallelStrategy, self).setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        assert self._timeout is not None  # NDParallel always gives one
        start_default_group(self.cluster_environment, self._process_group_backend, self._timeout, device_id=device_id)

    def _placement(self) -> Placement:
        return Placement(self.dims, self.global_rank, self.num_processes,
                         getattr(self.precision_plugin, "precision", None))

    @override
    def setup_environment(self) -> None:
        trainer = self._module().trainer
        lifecycle.before_processes(self.events, trainer, self.global_rank, self.world_size,
                                   self._get_process_group_backend())
        self._setup_distributed()
        self.auto_resume.install(trainer)  # `ckpt_path="auto"`: rank 0 chooses, for every rank
        mesh = build_mesh(self.dims, self.root_device.type)
        lifecycle.processes_started(self.events, mesh, self.dims, self.global_rank)
        self.steps.start(self.dims, mesh)
        self.failures.start()
        self.step_events.attach(self.root_device, lambda: trainer.global_step)
        # `configure_model` reads it as `self.device_mesh`: our named sub-meshes, not one DeviceMesh
        self._module()._device_mesh = mesh  # type: ignore[assignment]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Only ranks on different batch coordinates get different samples: tp ranks share a batch.
        return {"num_replicas": self.device_mesh.size("batch"), "rank": self.device_mesh.local_rank("batch")}

    # ---- model setup -----------------------------------------------------------------------------

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        with self.meta_build.context(empty_init, self.precision_plugin.tensor_init_context):
            yield

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.meta_build.resolve(self.model)
        self.plan.apply(self.model, self.device_mesh, self._placement(), trainer.log_dir if trainer.loggers else None)
        device = torch.device("cpu") if self.config.cpu_offload else self.root_device  # offload: FSDP moves them
        self._materialize(device)
        if not self.config.cpu_offload:
            self.model_to_device()
        self.steps.model_ready(self.model, self.report, self.plan.layout, self.precision_plugin, self.root_device)
        lifecycle.sync_metrics_over_batch_ranks(self._module(), self.device_mesh.group("batch"))
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.checkpointer.check_keepable(trainer)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, device)
        self.step_events.start_waiting()

    def _materialize(self, device: torch.device) -> None:
        """Meta shards become tensors (fake ones under `lightning_nd.check`); one seed for all, from rank 0."""
        self.meta_build.materialize(self.model, device, self.broadcast, self.plan.layout)  # type: ignore[arg-type]

    # ---- every step, in the order it runs ---------------------------------------------------------

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        trainer = self._module().trainer
        if trainer.training:
            self.step_events.batch_arrived()
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if trainer.training:
            self.preflight.first_batch(batch, trainer, self.plan.layout, self.global_rank, self.root_device)
        return self.steps.batch(batch)

    @override
    def on_train_start(self) -> None:
        trainer = self._module().trainer
        self.requeue.arm(trainer)  # after Lightning's own signal handlers
        flag_sigterm(trainer)  # no collective inside the handler: torchrun's SIGTERM comes while ranks report a failure

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.requeue.at_batch_start(self._module().trainer, self.root_device)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.checkpointer.before_training_step()
        self.checkpointer.poll_save()
        return self.steps.train(self._module(), super().training_step, args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.evaluate("val", self._module(), super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.evaluate("test", self._module(), super().test_step, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.evaluate("predict", self._module(), super().predict_step, args, kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        assert self.model is not None
        with accumulate_without_sync(self.model, self.plan.zero_stage()):
            yield None

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        assert self.model is not None
        if self.steps.pipeline is not None:
            return self.steps.pipeline_backward(self._module(), closure_loss, (self.pre_backward, self.post_backward))
        return self.steps.backward(self.model, lambda: super(LightningHooks, self).backward(
            closure_loss, optimizer, *args, **kwargs))

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        result = self.steps.optimizer_step(
            lambda closure: super(LightningHooks, self).optimizer_step(optimizer, closure, *args, **kwargs), closure)
        self.failures.after_optimizer_step()
        return result

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        # A logged value is the same on tp ranks: reduce over the ranks that saw different tokens only.
        with self.step_events.collective("reduce", "loss" if group is None else "group"):
            group = self.device_mesh.group("loss") if group is None else group
            return super().reduce(full_value(tensor) if isinstance(tensor, Tensor) else tensor, group, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Counted over every rank (Lightning compares the sum with world_size), not over `reduce`'s batch ranks.
        flag = self.reduce(torch.tensor(int(decision), device=self.root_device), torch.distributed.group.WORLD, "sum")
        return bool(flag == self.world_size) if all else bool(flag)

    # ---- checkpoints and failures ----------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.checkpointer.model_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.checkpointer.optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        self.checkpointer.save(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpointer.remove(lambda: super(LightningHooks, self).remove_checkpoint(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self.checkpointer.load(checkpoint_path, weights_only)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        return self.checkpointer.resumed_loader(super().process_dataloader(dataloader))

    def _checkpointed(self) -> CheckpointedRun:
        assert self.model is not None
        return CheckpointedRun(self.model, self.optimizers, self._module().trainer, self.dims, self.plan.layout)

    @override
    def on_exception(self, exception: BaseException) -> None:
        lifecycle.out_of_memory(self.events, self.global_rank, exception, lifecycle.trainer_of(self.lightning_module))
        self.failures.on_exception(exception)
        super().on_exception(exception)

    def _deliver_verdict(self, culprit: int, reason: str, thread: str, communication: bool) -> None:
        lifecycle.deliver_verdict(self.events, FailureVerdict(culprit, reason, self.global_rank, thread, communication),
                                  lifecycle.trainer_of(self.lightning_module))

    @override
    def teardown(self) -> None:
        self.checkpointer.end_saves()  # before the barrier: every rank's save commits, or is given up after a failure
        self.failures.teardown()
        super().teardown()

    def _module(self) -> LightningModule:
        assert self.lightning_module is not None, "the Trainer has connected the LightningModule"
        return self.lightning_module

