"""Running a rank's pipeline stages under a torch schedule: train/eval/predict steps, timings.

The checks and the bubble formula are `pipeline_parallel/schedules.py` (pure arithmetic). `PipelineRunner` wraps torch's
``PipelineStage`` objects and schedule for training: it feeds the model's inputs to every stage
(the first stage takes them as its input, later stages read positions, masks and shapes from
them), averages the loss over microbatches itself (so Lightning's gradient accumulation adds
steps up correctly), and hands the loss from the rank holding the last stage to every rank of the
pipeline. Evaluation and prediction run forward-only (`forward_only.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.distributed.tensor import DTensor

from lightning_nd.pipeline_parallel.forward_only import forward_only
from lightning_nd.pipeline_parallel.schedules import SINGLE_STAGE, check_microbatches
from lightning_nd.pipeline_parallel.shape_inference import zero_trial_inputs
from lightning_nd.pipeline_parallel.stage import pack_inputs
from lightning_nd.runtime.profiling import PIPELINE, label, phase_label

TORCH_NAMES = {
    "gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B", "looped_bfs": "LoopedBFS",
    "interleaved_zero_bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV",
}


class PipelineRunner:
    """A rank's stages and schedule, driven one batch at a time.

    ``stage_ranks[r]``: the stage indices pp rank ``r`` runs; ``stage_modules``: this rank's, in that order.
    torch sizes the buffers between stages from the first batch; a batch of other shapes (a short last
    batch, another sequence length) gets fresh stages and schedule, on every rank of the pipeline alike
    (they all see the same batch).
    """

    def __init__(
        self,
        stage_modules: Sequence[nn.Module],
        stage_ranks: Sequence[Sequence[int]],
        schedule: str,
        microbatches: int,
        group: dist.ProcessGroup,
        device: torch.device,
        report: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        """``report(kind, fields)``, when given, hears of every microbatch phase (kind ``phase``) and every
        point-to-point operation the schedule issues and completes (kind ``p2p``)."""
        pp_rank = dist.get_group_rank(group, dist.get_rank())
        self.num_stages = sum(len(stages) for stages in stage_ranks)
        self.modules = dict(zip(stage_ranks[pp_rank], stage_modules))
        self.owners = [0] * self.num_stages
        for rank, stages in enumerate(stage_ranks):
            for index in stages:
                self.owners[index] = dist.get_global_rank(group, rank)
        self.has_last = self.num_stages - 1 in self.modules
        self.last_stage_rank = self.owners[-1]
        self.schedule_name, self.microbatches, self.group, self.device = schedule, microbatches, group, device
        self._loss: Callable[[Any, Any], torch.Tensor] | None = None
        self._scale = 1.0
        self._shapes: list[tuple] | None = None
        self._compute = 0.0
        self._forwards = 0  # microbatch forwards run in this step
        self._report = report
        self._pending: list[dict[str, Any]] = []
        self.timings: dict[str, float] = {}

    def _build(self, shapes: list[tuple]) -> None:
        self._shapes = shapes
        stages = [PipelineStage(module, index, self.num_stages, self.device, group=self.group)
                  for index, module in self.modules.items()]
        for stage in stages:
            zero_trial_inputs(stage)
            for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, method, self._timed(getattr(stage, method), method, stage.stage_index))
            if self._report is not None:
                for method in ("get_fwd_recv_ops", "get_bwd_recv_ops", "get_fwd_send_ops", "get_bwd_send_ops"):
                    setattr(stage, method, self._issued(getattr(stage, method), method, stage.stage_index))
        cls = get_schedule_class(TORCH_NAMES[self.schedule_name])
        self.schedule = cls(stages[0] if self.schedule_name in SINGLE_STAGE else stages,
                            n_microbatches=self.microbatches, loss_fn=self._loss_fn, scale_grads=False)

    def _timed(self, fn: Callable, method: str, stage: int) -> Callable:
        """Time inside a stage's forward/backward; on CUDA synchronised, so it is device time, not launches."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        phase = method.removesuffix("_one_chunk")
        direction = "fwd" if phase == "forward" else "bwd"

        def timed(chunk: int, *args: Any, **kwargs: Any) -> Any:
            if self._report is not None and phase != "backward_weight":
                self._complete(lambda op: op["direction"] == direction and op["chunk"] == chunk
                               and op["op"] == "recv" and op["stage"] == stage)
            sync()
            self._forwards += phase == "forward"
            start = time.perf_counter()
            try:
                with phase_label(phase):
                    return fn(chunk, *args, **kwargs)
            finally:
                sync()
                duration = time.perf_counter() - start
                self._compute += duration
                if self._report is not None:
                    self._report("phase", {"phase": phase, "start_s": start, "duration_s": duration,
                                           "microbatch": chunk, "stage": stage})

        return timed

    def _issued(self, fn: Callable, method: str, stage: int) -> Callable:
        """Hear of the point-to-point operations the schedule is about to issue for a stage."""
        _, direction, kind, _ = method.split("_")

        def issued(chunk: int) -> list:
            assert self._report is not None, "the stages' operations are wrapped only when reporting"
            ops = fn(chunk)
            for op in ops:
                record = {"op": kind, "peer": op.peer, "bytes": op.tensor.numel() * op.tensor.element_size(),
                          "direction": direction, "chunk": chunk, "stage": stage}
                self._pending.append(record)
                self._report("p2p", {**record, "state": "issued", "time_s": time.perf_counter()})
            return ops

        return issued

    def _complete(self, done: Callable[[dict[str, Any]], bool]) -> None:
        """Mark pending operations complete: receives before the chunk that uses them runs, the rest at step end."""
        assert self._report is not None, "operations are pending only when reporting"
        finished = [op for op in self._pending if done(op)]
        self._pending = [op for op in self._pending if not done(op)]
        for op in finished:
            self._report("p2p", {**op, "state": "completed", "time_s": time.perf_counter()})

    def _loss_fn(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        if not self._forwards:
            # torch sizes the backward buffers from a loss on placeholder outputs (uninitialised memory) before
            # the first microbatch runs: a loss of the right graph, without running the module's code on them.
            return output.sum() * 0.0
        assert self._loss is not None, "`train_step` sets the loss before the schedule runs"
        return self._loss(output, target) * self._scale

    def train_step(self, inputs: Any, target: Any, loss: Callable, accumulate: int = 1) -> torch.Tensor:
        """Forward and backward over every microbatch; gradients as for one batch whose loss is the
        microbatch mean divided by ``accumulate``. Returns the (unscaled) mean loss on every rank."""
        kwargs = pack_inputs(inputs)
        check_microbatches(kwargs, self.microbatches)
        shapes = [(k, tuple(v.shape), v.dtype) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        if shapes != self._shapes:
            self._build(shapes)
        self._loss, self._scale = loss, 1.0 / (self.microbatches * accumulate)
        losses: list[torch.Tensor] = []
        self._compute, self._forwards = 0.0, 0
        start = time.perf_counter()
        with label(PIPELINE):
            self.schedule.step(target=target if self.has_last else None, losses=losses if self.has_last else None,
                               return_outputs=False, **kwargs)
            if self._report is not None:
                self._complete(lambda op: True)  # the schedule waited on every operation before returning
            total = torch.stack([full_value(l).detach() for l in losses]).sum() * accumulate if losses else None
            shared = self._share(total)  # the last stage waits here for the first's last backward
        wall = time.perf_counter() - start
        idle = max(wall - self._compute, 0.0)
        self.timings = {"step_s": wall, "compute_s": self._compute, "idle_s": idle,
                        "idle_fraction": idle / wall if wall > 0 else 0.0}
        return shared

    def forward_chunks(self, inputs: Any, target: Any, finish: Callable[[torch.Tensor, Any], None]) -> None:
        """Forward-only over up to ``microbatches`` chunks (a short last batch splits unevenly); ``finish`` gets
        each last-stage output with its part of ``target`` (None without one)."""
        kwargs = pack_inputs(inputs)
        size = next(v.shape[0] for v in kwargs.values() if isinstance(v, torch.Tensor))
        chunks = min(self.microbatches, size)
        parts = torch.tensor_split(target, chunks) if target is not None else [None] * chunks
        forward_only(self.modules, self.owners, kwargs, chunks, self.device,
                     lambda output, index: finish(output, parts[index]), self._report)
        self._reshard()

    def _reshard(self) -> None:
        """Leave the FSDP units sharded, as training leaves them. A forward without backward keeps gathered the units
        that do not reshard after forward (each stage's root unit; every block at zero_stage 2), and while a unit is
        gathered its modules' ``parameters()`` are the gathered copies: the next training step would set aside and
        hand back the gradients of those copies (None) instead of the sharded parameters' (a validation under pp x FSDP
        cost the next optimizer step its gradients)."""
        for stage in self.modules.values():
            for module in stage.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def eval_step(self, inputs: Any, target: Any, loss: Callable) -> torch.Tensor:
        """The per-sample mean loss of the batch (microbatch losses weighted by size), on every rank."""
        weighted: list[torch.Tensor] = []
        self.forward_chunks(inputs, target, lambda output, part: weighted.append(
            full_value(loss(output, part)).detach().float() * part.shape[0]))
        return self._share(torch.stack(weighted).sum() / target.shape[0] if weighted else None)

    def _share(self, value: torch.Tensor | None) -> torch.Tensor:
        result = value.float().to(self.device) if value is not None else torch.zeros((), device=self.device)
        dist.broadcast(result, src=self.last_stage_rank, group=self.group)
        return result


def full_value(value: torch.Tensor) -> torch.Tensor:
    """A loss or logits under loss parallel are DTensors: their full value."""
    return value.full_tensor() if isinstance(value, DTensor) else value
