"""`PipelineEngine`: how `NDParallel` runs Lightning's steps under pp, through the pipeline schedule.

Under pp the strategy does not call the module's ``training_step``/``validation_step``: a stage
cannot run the whole model. It asks the module two small questions instead, both optional:

- ``pipeline_inputs(batch) -> (inputs, target)``: what the model is called with (a tensor, a tuple
  of positional inputs or a dict of keyword inputs) and what the loss compares its output with.
  Default: for a dict, ``labels``/``targets``/``target``/``y`` is the target and every other key a
  keyword input (``attention_mask`` included); for a pair, ``(inputs, target)``.
- ``pipeline_loss(output, target) -> Tensor``: the mean loss of one microbatch. Default:
  cross-entropy of the output (logits) against integer targets of one dimension less, ignoring
  -100, with targets already aligned to the outputs. Hugging Face batches (``input_ids`` with
  unshifted ``labels``) must define it (the error says how).

The mean loss over microbatches reaches every rank and is logged as ``train_loss`` /
``val_loss`` / ``test_loss`` (``prog_bar=True, sync_dist=True``), so progress bar, loggers,
``ModelCheckpoint(monitor=...)`` and early stopping work as without pp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_nd.layout.record import Layout
from lightning_nd.parallel.pipeline.schedule import PipelineRunner
from lightning_nd.parallel.compose import ParallelizeReport
from lightning_nd.runtime.clip import align_grads_to_params

TARGET_KEYS = ("labels", "targets", "target", "y")
HF_LOSS = ("def pipeline_loss(self, logits, labels): return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(),"
           " labels[:, 1:].flatten(), ignore_index=-100)")


def split_batch(module: LightningModule, batch: Any, need_target: bool = True) -> tuple[Any, Any]:
    """(inputs, target) of a batch; for prediction the target may be missing."""
    hook = getattr(module, "pipeline_inputs", None)
    if callable(hook):
        return hook(batch)
    if isinstance(batch, dict):
        key = next((k for k in TARGET_KEYS if k in batch), None)
        inputs = {k: v for k, v in batch.items() if k != key}
        if key == "labels" and "input_ids" in batch and not callable(getattr(module, "pipeline_loss", None)):
            raise ValueError(
                "A Hugging Face-style batch (`input_ids`, `labels`) holds labels unshifted (the model shifts them"
                " inside its own loss); under pipeline parallelism the last stage computes the loss from the logits"
                f" instead. HINT: define on `{type(module).__name__}`: `{HF_LOSS}`."
            )
        if inputs and (key is not None or not need_target):
            return inputs, batch.get(key)
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    elif isinstance(batch, Tensor) and not need_target:
        return batch, None
    raise ValueError(
        f"Under pipeline parallelism the strategy runs the model itself and cannot tell inputs from targets in a"
        f" batch of type {type(batch).__name__}{' with keys ' + str(list(batch)) if isinstance(batch, dict) else ''}."
        f" HINT: define `def pipeline_inputs(self, batch): return batch['x'], batch['y']` on `{type(module).__name__}`."
    )


def pipeline_loss(module: LightningModule, output: Tensor, target: Tensor) -> Tensor:
    hook = getattr(module, "pipeline_loss", None)
    if callable(hook):
        return hook(output, target)
    if isinstance(target, Tensor) and not target.is_floating_point() and output.ndim == target.ndim + 1:
        return F.cross_entropy(output.flatten(0, -2).float(), target.flatten(), ignore_index=-100)
    raise ValueError(
        f"Under pipeline parallelism the last stage computes the loss, and the default (cross-entropy over logits)"
        f" does not fit an output of shape {tuple(output.shape)} and a target of shape"
        f" {tuple(getattr(target, 'shape', ()))}. HINT: define `def pipeline_loss(self, output, target): ...` on"
        f" `{type(module).__name__}`."
    )


class PipelineEngine:
    """A rank's pipeline: the schedule runner and the gradients it hands back to Lightning's backward."""

    def __init__(self, strategy: Any, report: ParallelizeReport, layout: Layout, group: Any, device: torch.device,
                 on_operation: Callable[[str, dict[str, Any]], None] | None) -> None:
        """``report``: what the composer built (this rank's stages); ``on_operation``: hears of microbatch phases
        and point-to-point operations (None when nobody listens)."""
        assert layout.pipeline is not None
        self.strategy, self.report = strategy, report
        self.runner = PipelineRunner(report.stages, layout.pipeline.ranks, layout.options["pp_schedule"],
                                     layout.options["pp_microbatches"], group, device, on_operation)
        self._grads: list[Tensor | None] = []
        self._window_open = False

    @property
    def timings(self) -> dict[str, float]:
        return dict(self.runner.timings)

    def window_closed(self) -> None:
        """The optimizer stepped: the next training step starts a new accumulation window."""
        self._window_open = False

    def train(self, module: LightningModule, batch: Any) -> Tensor:
        """Forward and backward of the whole batch. Lightning zeroes gradients between the training step
        and backward, so the gradients are set aside here and put back in `backward`."""
        if not module.automatic_optimization:
            raise ValueError(
                f"`{type(module).__name__}.automatic_optimization = False`: under pipeline parallelism the strategy"
                " runs forward and backward inside the schedule, so a manual `training_step` cannot run. HINT: use"
                " automatic optimization (the default) with pp, or pp=1."
            )
        accumulate = module.trainer.accumulate_grad_batches
        params = list(module.parameters())
        if not self._window_open:  # a new accumulation window: what is there belongs to the last step
            self._window_open = True
            for param in params:
                param.grad = None
        inputs, target = split_batch(module, batch)
        with self.strategy.precision_plugin.train_step_context():
            loss = self.runner.train_step(inputs, target, lambda out, tgt: pipeline_loss(module, out, tgt),
                                          accumulate=accumulate)
        self._grads = [param.grad for param in params]
        for param in params:
            param.grad = None
        module.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def evaluate(self, module: LightningModule, batch: Any, stage: str) -> Tensor:
        inputs, target = split_batch(module, batch)
        context = (self.strategy.precision_plugin.val_step_context if stage == "val"
                   else self.strategy.precision_plugin.test_step_context)
        with context():
            loss = self.runner.eval_step(inputs, target, lambda out, tgt: pipeline_loss(module, out, tgt))
        module.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def predict(self, module: LightningModule, batch: Any) -> Tensor:
        inputs, _ = split_batch(module, batch, need_target=False)
        with self.strategy.precision_plugin.predict_step_context():
            return self.runner.predict_step(inputs)

    def backward(self, module: LightningModule, loss: Tensor) -> Tensor:
        """The schedule ran backward already; its gradients come back, Lightning's hooks still run."""
        for param, grad in zip(module.parameters(), self._grads):
            param.grad = grad
        self._grads = []
        align_grads_to_params(module.parameters())
        strategy = self.strategy
        strategy.pre_backward(loss)
        loss = strategy.precision_plugin.pre_backward(loss, module)
        loss = strategy.precision_plugin.post_backward(loss, module)
        strategy.post_backward(loss)
        return loss
