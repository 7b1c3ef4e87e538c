"""`StepHooks`: the hooks Lightning calls in every step, each defined once, in the order a step runs them:
the batch arrives (cp sharding, sequence checks), training step (the pipeline engine under pp, the step
context: loss parallel and the cp region), backward, optimizer step (then the failure monitor's switch to
the short timeout), and the reductions logging makes. Base of `NDParallel`, which owns the state they use.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_nd.layout.options import resolve_options
from lightning_nd.layout.validate import check_sequence_lengths
from lightning_nd.parallel.context.sharding import shard_batch
from lightning_nd.parallel.fsdp import accumulate_without_sync
from lightning_nd.runtime.clip import align_grads_to_params, clip_grad_norm_
from lightning_nd.strategy import lifecycle


class StepHooks(ModelParallelStrategy):
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        training = self.lightning_module.trainer.training
        if training:
            self.step_events.batch_arrived()
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if training:
            self.preflight.first_batch(self, batch)
        if self.dims.cp > 1:
            batch, self._cp_positions = shard_batch(batch, self.dims.cp, self.device_mesh.local_rank("cp"),
                                                    self.config.cp_shard_keys)
        if self.config.sequence_parallel:
            check_sequence_lengths(batch, self.dims.tp)
        return batch

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.checkpointer.before_training_step()
        # Under pp the runner reports each microbatch's phases itself.
        with self.step_events.phase("forward") if self.pipeline is None else nullcontext(), lifecycle.step_context(self):
            result = (self.pipeline.train(self.lightning_module, args) if self.pipeline is not None
                      else super().training_step(*args, **kwargs))
        self.step_events.step_done(self.pipeline_timings)
        return result

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_step("val", super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_step("test", super().test_step, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_step("predict", super().predict_step, args, kwargs)

    def _forward_step(self, stage: str, step: Any, args: tuple, kwargs: dict) -> Any:
        """Evaluation and prediction: through the pipeline when there is one, inside the step context."""
        with lifecycle.step_context(self):
            if self.pipeline is None:
                return step(*args, **kwargs)
            if stage == "predict":
                return self.pipeline.predict(self.lightning_module, args)
            return self.pipeline.evaluate(self.lightning_module, args, stage)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        assert self.model is not None
        # Without a Layout (`configure_model` parallelized the model itself) the option still says what it means.
        options = self._layout.options if self._layout else resolve_options(self.dims.as_dict(), self.config)
        with accumulate_without_sync(self.model, options["zero_stage"]):
            yield None

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.pipeline is not None:
            loss = self.pipeline.backward(self.lightning_module, closure_loss)
            self.step_events.backward_done()  # the schedule ran forward and backward: the optimizer's time begins
            return loss
        with self.step_events.phase("backward"), lifecycle.step_context(self, forward=False):
            loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        self.step_events.backward_done()
        # Gradients whose layout differs from their parameter's (Partial under SP, a full copy for a
        # sharded embedding) are aligned now: clipping, hooks and the optimizer see the true shard.
        assert self.model is not None
        align_grads_to_params(self.model.parameters())
        return loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is not None:  # a tied weight's copies sum their gradients after backward, before clipping
            closure = self.pipeline.tied.after(closure)
        with self.step_events.optimizer():
            result = super().optimizer_step(optimizer, closure, *args, **kwargs)
        if self.pipeline is not None:
            self.pipeline.window_closed()
        self.failures.after_optimizer_step()
        return result

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        # A logged value is the same on tp ranks: reduce over the ranks that saw different tokens only.
        if isinstance(tensor, DTensor):  # a loss-parallel loss: replicated over tp
            tensor = tensor.full_tensor()
        with self.step_events.collective("reduce", "loss" if group is None else "group"):
            return super().reduce(tensor, group=group if group is not None else self.device_mesh.group("loss"),
                                  reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # A decision is counted over every rank (Lightning compares the sum with world_size),
        # not over the batch ranks `reduce` uses by default.
        import torch.distributed as dist

        flag = torch.tensor(int(decision), device=self.root_device)
        flag = self.reduce(flag, group=dist.group.WORLD, reduce_op="sum")
        return bool(flag == self.world_size) if all else bool(flag)

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        with self.step_events.collective("clip_grad_norm", "world"):
            clip_grad_norm_(self.precision_plugin.main_params(optimizer), clip_val, pp=self.dims.pp)
