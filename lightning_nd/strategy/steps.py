"""`Steps`: every step's way through `NDParallel`. A batch is split along the sequence over cp (this rank's
tokens and their global positions kept for the step) and checked against sequence parallel's split; the step
and its backward run inside loss parallel and the context-parallel region, through the pipeline engine when
there is one, each phase reported (`step_events.py`); gradients are aligned with their parameters after backward.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_nd.context_parallel.region import context_parallel_region
from lightning_nd.context_parallel.sharding import every_shard_positions, shard_batch
from lightning_nd.expert_parallel.lists import mark_expert_shares
from lightning_nd.layout.options import ParallelConfig
from lightning_nd.layout.record import Layout
from lightning_nd.layout.validate import check_sequence_lengths
from lightning_nd.mesh.build import NDMesh
from lightning_nd.mesh.dims import ParallelDims
from lightning_nd.nn.moe import MoE, moe_layers
from lightning_nd.parallel.compose import ParallelizeReport
from lightning_nd.runtime.clip import align_grads_to_params, clip_grad_norm_
from lightning_nd.strategy.pipeline_engine import PipelineEngine
from lightning_nd.strategy.step_events import StepEvents

Step = Callable[..., Any]


class Steps:
    def __init__(self, config: ParallelConfig, events: StepEvents) -> None:
        self.config, self.events = config, events
        self.pipeline: PipelineEngine | None = None
        self._mesh: tuple[ParallelDims, NDMesh] | None = None
        self._positions: Tensor | None = None
        self._balanced: list[MoE] = []

    def start(self, dims: ParallelDims, mesh: NDMesh) -> None:
        """The processes have started: the run's dims and mesh."""
        self._mesh, self._positions = (dims, mesh), None

    @property
    def mesh(self) -> NDMesh:
        if self._mesh is None:
            raise RuntimeError("The device mesh exists once the processes have started (in `configure_model` and"
                               " later).")
        return self._mesh[1]

    def model_ready(self, model: nn.Module, report: ParallelizeReport | None, layout: Layout | None,
                    precision: Precision, device: torch.device) -> None:
        """After the composer: the pipeline engine of this rank's stages (kept when the model is the same), the MoE
        layers whose loss-free bias moves after each step, and gradient clipping over the mesh's shards (listed experts'
        parameters marked for it)."""
        assert self._mesh is not None
        dims, mesh = self._mesh
        if report is not None and report.stages and layout is not None and (
                self.pipeline is None or self.pipeline.report is not report):
            self.pipeline = PipelineEngine(report, layout, mesh, precision, device, self.events.report("pp"))
        self._balanced = [layer for layer in moe_layers(model) if layer.bias_update_rate]
        mark_expert_shares(model)

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: int | float) -> None:
            with self.events.collective("clip_grad_norm", "world"):
                clip_grad_norm_(precision.main_params(optimizer), clip_val, pp=dims.pp)

        # Lightning clips through the precision plugin, which has no strategy hook.
        precision.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    @property
    def timings(self) -> dict[str, float]:
        """The pipeline's last step on this rank (empty without pp)."""
        return self.pipeline.timings if self.pipeline is not None else {}

    def batch(self, batch: Any) -> Any:
        """This rank's part of a batch on the device: its cp shard of the sequence (its positions kept)."""
        assert self._mesh is not None, "a batch reaches the strategy after `setup_environment`"
        dims, mesh = self._mesh
        if dims.cp > 1:
            batch, self._positions = shard_batch(batch, dims.cp, mesh.local_rank("cp"), self.config.cp_shard_keys)
        if self.config.sequence_parallel:
            check_sequence_lengths(batch, dims.tp)
        return batch

    def context(self, forward: bool = True) -> ExitStack:
        """What a step (``forward``) and its backward run inside: loss parallel, and the context-parallel region."""
        stack = ExitStack()
        if self.config.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        if self._positions is not None and self._mesh is not None:
            cp = self._mesh[0].cp  # `shard_batch` gave every cp rank its head-tail shard: the ring knows them all
            every = every_shard_positions(self._positions.numel() * cp, cp)
            stack.enter_context(context_parallel_region(self._mesh[1].group("cp"), self._positions,
                                                        expect_attention=forward, report=self.events.report("cp"),
                                                        every_position=every))
        return stack

    def train(self, module: LightningModule, step: Step, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Lightning's training step (``step``), or under pp forward and backward of the whole batch."""
        # Under pp the runner reports each microbatch's phases itself.
        with self.events.phase("forward") if self.pipeline is None else nullcontext(), self.context():
            result = self.pipeline.train(module, args) if self.pipeline is not None else step(*args, **kwargs)
        self.events.step_done(self.timings)
        return result

    def evaluate(self, stage: str, module: LightningModule, step: Step, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        """Evaluation and prediction: through the pipeline when there is one, inside the step context."""
        with self.context():
            if self.pipeline is None:
                return step(*args, **kwargs)
            if stage == "predict":
                return self.pipeline.predict(module, args)
            return self.pipeline.evaluate(module, args, stage)

    def backward(self, model: nn.Module, backward: Callable[[], Tensor]) -> Tensor:
        """Lightning's backward (``backward``); without pp only: the schedule ran it under pp."""
        with self.events.phase("backward"), self.context(forward=False):
            loss = backward()
        self.events.backward_done()
        # Gradients whose layout differs from their parameter's (Partial under SP, a full copy for a
        # sharded embedding) are aligned now: clipping, hooks and the optimizer see the true shard.
        align_grads_to_params(model.parameters())
        return loss

    def pipeline_backward(self, module: LightningModule, loss: Tensor, around: tuple[Callable[[Tensor], None],
                          Callable[[Tensor], None]]) -> Tensor:
        """Under pp the schedule ran backward: its gradients come back, and the hooks ``around`` backward (the
        strategy's ``pre_backward`` and ``post_backward``) and the precision plugin's run."""
        assert self.pipeline is not None
        around[0](loss)
        loss = self.pipeline.backward(module, loss)
        around[1](loss)
        self.events.backward_done()  # the optimizer's time begins
        return loss

    def optimizer_step(self, step: Callable[[Callable[[], Any]], Any], closure: Callable[[], Any]) -> Any:
        """Lightning's optimizer step (``step(closure)``), timed; under pp a tied weight's copies sum their
        gradients after backward, before clipping, and the accumulation window closes; after it, the MoE layers
        with a loss-free bias (``bias_update_rate``) move it against their load over the batch ranks."""
        if self.pipeline is not None:
            closure = self.pipeline.tied.after(closure)
        with self.events.optimizer():
            result = step(closure)
        if self._balanced:  # the loss-free bias: each layer's load over the step's batch ranks, then its bias moves
            group = self.mesh.group("loss") if self.mesh.size("loss") > 1 else None
            for layer in self._balanced:
                layer.update_bias(group)
        if self.pipeline is not None:
            self.pipeline.window_closed()
        return result
