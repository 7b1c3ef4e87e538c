"""`PipelineEngine`: how `NDParallel` runs Lightning's steps under pp, through the pipeline schedule.

By default the module's own ``training_step`` / ``validation_step`` / ``test_step`` drive the pipeline
(`pipeline_parallel/own_steps.py`): their model call gives the first stage's inputs, and on the last stage it returns the
model's output for each microbatch, so the loss and what the step logs are the module's own.

Two optional hooks replace parts of that:

- ``pipeline_inputs(batch) -> (inputs, target)``: what the model is called with (a tensor, a tuple of
  positional inputs or a dict of keyword inputs), instead of the step's own call; ``target`` is what
  ``pipeline_loss`` compares the output with.
- ``pipeline_loss(output, target) -> Tensor``: the mean loss of one microbatch, computed by the strategy
  on the last stage instead of the step (the step is then not run under pp). Its mean over microbatches
  reaches every rank and is logged as ``train_loss`` / ``val_loss`` / ``test_loss`` (``prog_bar=True,
  sync_dist=True``). Without ``pipeline_inputs`` its batch must be an ``(inputs, target)`` pair.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor

from lightning_nd.layout.record import Layout
from lightning_nd.layout.validate import check_router_logits_under_pp
from lightning_nd.mesh.build import NDMesh
from lightning_nd.parallel.compose import ParallelizeReport
from lightning_nd.pipeline_parallel import own_steps
from lightning_nd.pipeline_parallel.aux_losses import attach
from lightning_nd.pipeline_parallel.batch_join import NotJoinable, join_microbatches, map_tensors
from lightning_nd.pipeline_parallel.metric_calls import MetricCalls
from lightning_nd.pipeline_parallel.runner import PipelineRunner, full_value
from lightning_nd.pipeline_parallel.stage import pack_inputs
from lightning_nd.pipeline_parallel.tied import TiedWeights
from lightning_nd.runtime.clip import align_grads_to_params


def split_batch(module: LightningModule, batch: Any, need_target: bool = True) -> tuple[Any, Any]:
    """(inputs, target) of a batch for `pipeline_loss`; for prediction the target may be missing."""
    hook = getattr(module, "pipeline_inputs", None)
    if callable(hook):
        return hook(batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if not need_target:
        return batch, None
    raise ValueError(
        f"`{type(module).__name__}` defines `pipeline_loss`, so under pipeline parallelism the strategy scores the"
        f" model's output itself, and it cannot tell inputs from target in a batch of type {type(batch).__name__}"
        f"{' with keys ' + str(list(batch)) if isinstance(batch, Mapping) else ''}. HINT: either define"
        " `def pipeline_inputs(self, batch): return batch['x'], batch['y']`, or remove `pipeline_loss` so that your"
        " own `training_step` computes the loss from the model's output (the default under pp)."
    )


def _pipeline_loss(module: LightningModule) -> Callable[[Any, Any], Tensor]:
    """The module's ``pipeline_loss(output, target)`` hook."""
    return cast(Callable[[Any, Any], Tensor], module.pipeline_loss)


class PipelineEngine:
    """A rank's pipeline: the schedule runner and the gradients it hands back to Lightning's backward."""

    def __init__(self, report: ParallelizeReport, layout: Layout, mesh: NDMesh, precision: Precision,
                 device: torch.device, on_operation: Callable[[str, dict[str, Any]], None] | None) -> None:
        """``report``: what the composer built (this rank's stages); ``precision``: the strategy's precision plugin
        (the steps' contexts); ``on_operation``: hears of microbatch phases and point-to-point operations (None when
        nobody listens)."""
        assert layout.pipeline is not None
        self.report, self.precision, self.pp = report, precision, layout.dims["pp"]
        group = mesh.group("pp")
        self.runner = PipelineRunner(report.stages, layout.pipeline.ranks, layout.options.pp_schedule,
                                     layout.options.pp_microbatches, group, device, on_operation)
        self.tied = TiedWeights(report.stages, layout.pipeline, mesh)
        self._grads: list[Tensor | None] = []
        self._window_open = False
        self.attribute, self.device = layout.pipeline.attribute, device
        self._outputs: dict[int, Any] = {}  # the last stage's model output per microbatch, by its handed-on tensor
        self._keeping = False
        self._metrics = MetricCalls()
        for stage in report.stages:
            if stage.is_last:
                stage.on_output = self._keep_output
        # Whether any stage's MoE auxiliary losses count (asked once, of every rank of the pipeline).
        weighted = torch.tensor(float(any(stage.aux.weighted for stage in report.stages)), device=device)
        torch.distributed.all_reduce(weighted, op=torch.distributed.ReduceOp.MAX, group=group)
        self._aux_weighted = bool(weighted)

    @property
    def timings(self) -> dict[str, float]:
        return dict(self.runner.timings)

    def window_closed(self) -> None:
        """The optimizer stepped: the next training step starts a new accumulation window."""
        self._window_open = False

    def train(self, module: LightningModule, args: tuple) -> Tensor | None:
        """Forward and backward of the whole batch (``args``: the training step's). Lightning zeroes gradients
        between the training step and backward, so the gradients are set aside here and put back in `backward`."""
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
        loss: Tensor | None
        with self.precision.train_step_context():
            if self._scored_by_strategy(module):
                loss = self._hooked_train(module, args, accumulate)
            else:
                loss = self._own_train(module, args, accumulate)
        if loss is None:
            return None
        self._grads = [param.grad for param in params]
        for param in params:
            param.grad = None
        if self._scored_by_strategy(module):
            module.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def evaluate(self, module: LightningModule, args: tuple, stage: str) -> Tensor | None:
        context = self.precision.val_step_context if stage == "val" else self.precision.test_step_context
        with context():
            if not self._scored_by_strategy(module):
                return self._own_evaluate(module, args, "validation_step" if stage == "val" else "test_step")
            inputs, target = split_batch(module, args[0])
            loss = self.runner.eval_step(inputs, target, _pipeline_loss(module))
        module.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def predict(self, module: LightningModule, args: tuple) -> Any:
        """What ``predict_step`` returns in one process, on every rank of the pipeline: on the last stage it runs once,
        its model call answered by the model's outputs of every microbatch joined into the batch's."""
        with self.precision.predict_step_context():
            inputs = self._inputs(module, module.predict_step, args)
            if inputs is None:
                raise ValueError(f"`{type(module).__name__}.predict_step` did not call the model. HINT: call it, or"
                                 " define `pipeline_inputs(batch)`.")
            run = own_steps.StepRun(module, self.attribute, module.predict_step, self._metrics)
            outputs: list[Any] = []
            with self._keeping_outputs():
                self.runner.forward_chunks(inputs, None, lambda output, part: outputs.append(self._model_output(output)))
            if self.runner.has_last:
                run.value = run.guarded(lambda: self._predicted(run, args, outputs), lambda: None)
            return run.shared(self.runner.has_last, self.runner.last_stage_rank, self.runner.group, self.device)

    @staticmethod
    def _predicted(run: own_steps.StepRun, args: tuple, outputs: list[Any]) -> Any:
        try:
            output = join_microbatches(outputs, "the model's output")
        except NotJoinable as error:
            raise ValueError(
                f"`{run.name}`: the model's outputs of the {len(outputs)} microbatches do not join into the batch's:"
                f" {error}. Under pipeline parallelism `predict_step` runs once on the last stage with the model's"
                " output for the whole batch, joined from its microbatches. HINT: call the model so that it returns"
                " per-sample values only (e.g. without `labels`, whose loss is one number per microbatch)."
            ) from None
        return run.score(args, output)[0]

    @staticmethod
    def _scored_by_strategy(module: LightningModule) -> bool:
        return callable(getattr(module, "pipeline_loss", None))

    def _inputs(self, module: LightningModule, step: Callable[..., Any], args: tuple) -> dict[str, Any] | None:
        hook = getattr(module, "pipeline_inputs", None)
        if callable(hook):
            return pack_inputs(hook(args[0])[0])
        inputs = own_steps.capture(module, self.attribute, step, args, self._metrics)
        if inputs is not None and inputs.get("output_router_logits"):
            check_router_logits_under_pp(module, self.pp, asked=True)
        return inputs

    def _model_output(self, main: Tensor) -> Any:
        """What the model returned on the last stage for the microbatch that handed on ``main``, whole."""
        return map_tensors(self._outputs.pop(id(main), (main,))[0], full_value)

    def _keep_output(self, main: Tensor, output: Any, aux: Tensor | None) -> None:
        if self._keeping:
            self._outputs[id(main)] = (output, aux)

    @contextmanager
    def _adding_aux_losses(self, scale: float) -> Iterator[None]:
        for stage in self.report.stages:
            stage.aux.scale = scale
        try:
            yield
        finally:
            for stage in self.report.stages:
                stage.aux.scale = 0.0

    @contextmanager
    def _keeping_outputs(self) -> Iterator[None]:
        self._outputs.clear()
        self._keeping = True
        try:
            yield
        finally:
            self._keeping = False
            self._outputs.clear()

    def _hooked_train(self, module: LightningModule, args: tuple, accumulate: int) -> Tensor:
        """``pipeline_loss`` scores each microbatch; the MoE layers' auxiliary losses count in the gradients as one
        process's ``pipeline_loss(...) + moe_aux_loss(model)`` would (each stage adds its own, the last one through
        an identity on the microbatch loss), while the loss reported stays ``pipeline_loss``'s."""
        inputs, target = split_batch(module, args[0])
        score, scale = _pipeline_loss(module), 1.0 / (self.runner.microbatches * accumulate)

        def loss(output: Tensor, tgt: Any) -> Tensor:
            value = score(output, tgt)
            _, aux = self._outputs.pop(id(output), (output, None))
            return attach(value, aux.to(value.dtype), scale) if aux is not None and self._aux_weighted else value

        with self._keeping_outputs(), self._adding_aux_losses(scale if self._aux_weighted else 0.0):
            return self.runner.train_step(inputs, target, loss, accumulate=accumulate)

    def _own_train(self, module: LightningModule, args: tuple, accumulate: int) -> Tensor | None:
        inputs = self._inputs(module, module.training_step, args)
        if inputs is None:
            return None
        count, size = self.runner.microbatches, own_steps.batch_size(inputs)
        run = own_steps.StepRun(module, self.attribute, module.training_step, self._metrics)

        def score(output: Tensor, index: Tensor) -> Tensor:
            piece = (own_steps.microbatch(args[0], int(index), count, size), *args[1:])
            returned, aux = self._outputs.pop(id(output), (output, None))
            result, asked = run.score(piece, returned)
            value = own_steps.step_loss(result, run.name)
            if not asked and self._aux_weighted:
                raise ValueError(
                    f"`{run.name}` does not add the MoE auxiliary losses (`moe_aux_loss(self.model)`), but under"
                    " pipeline parallelism every stage adds its layers' losses to its backward. HINT: add"
                    " `moe_aux_loss(self.model)` to the loss as with one process, or set the layers' `aux_loss_coef=0`"
                    " and `z_loss_coef=0`."
                )
            return own_steps.plus(value, aux)

        def loss(output: Tensor, index: Tensor) -> Tensor:  # a failed microbatch backpropagates zeros, then raises
            return run.guarded(lambda: score(output, index), lambda: output.sum() * 0.0)

        with self._keeping_outputs(), self._adding_aux_losses(1.0 / (count * accumulate)):
            value = self.runner.train_step(inputs, torch.arange(count, device=self.device), loss, accumulate=accumulate)
        run.shared(self.runner.has_last, self.runner.last_stage_rank, self.runner.group, self.device)
        return value

    def _own_evaluate(self, module: LightningModule, args: tuple, name: str) -> Tensor | None:
        step = getattr(module, name)
        inputs = self._inputs(module, step, args)
        if inputs is None:
            return None
        size = own_steps.batch_size(inputs)
        count = min(self.runner.microbatches, size)
        rows = [len(part) for part in torch.tensor_split(torch.arange(size), count)]
        run, losses = own_steps.StepRun(module, self.attribute, step, self._metrics), []

        def score(output: Tensor, index: Tensor) -> None:
            i = int(index)
            run.logged.weight = float(rows[i])
            result, _ = run.score((own_steps.microbatch(args[0], i, count, size), *args[1:]),
                                  self._outputs.pop(id(output), (output,))[0])
            loss = result.get("loss") if isinstance(result, Mapping) else result
            if isinstance(loss, Tensor):
                losses.append(float(full_value(loss).detach().float()) * rows[i])

        with self._keeping_outputs():
            self.runner.forward_chunks(inputs, torch.arange(count, device=self.device),
                                       lambda output, index: run.guarded(lambda: score(output, index), lambda: None))
        run.value = sum(losses) / size if losses else None
        value = run.shared(self.runner.has_last, self.runner.last_stage_rank, self.runner.group, self.device)
        return None if value is None else torch.tensor(value, device=self.device)

    def backward(self, module: LightningModule, loss: Tensor) -> Tensor:
        """The schedule ran backward already: its gradients come back where Lightning's backward leaves them, and the
        precision plugin's hooks around backward run."""
        for param, grad in zip(module.parameters(), self._grads):
            param.grad = grad
        self._grads = []
        align_grads_to_params(module.parameters())
        return self.precision.post_backward(self.precision.pre_backward(loss, module), module)
