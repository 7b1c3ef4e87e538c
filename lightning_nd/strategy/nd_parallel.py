"""`NDParallel`: N-D parallel training as a Lightning strategy. This file is what a user writes and reads: the
keywords (their docs generated from `layout/arguments.py`'s table), `from_config`, the run's Layout, report and
timings; what Lightning calls is `hooks.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

from lightning_nd.layout.arguments import KEYWORDS, check_keywords, read_arguments, split_arguments
from lightning_nd.layout.record import Layout
from lightning_nd.runtime.timeouts import HEARTBEAT_TIMEOUT, INIT_TIMEOUT, STEP_TIMEOUT, check_timeouts
from lightning_nd.strategy.auto_resume import AutoResume
from lightning_nd.strategy.checkpointer import Checkpointer
from lightning_nd.strategy.events import EventBus
from lightning_nd.strategy.failure_monitor import FailureMonitor
from lightning_nd.strategy.hooks import LightningHooks
from lightning_nd.strategy.meta_build import MetaBuild
from lightning_nd.strategy.preflight import Preflight
from lightning_nd.strategy.quiet import silence_internal_warnings
from lightning_nd.strategy.requeue import Requeue
from lightning_nd.strategy.run_plan import RunPlan
from lightning_nd.strategy.step_events import StepEvents
from lightning_nd.strategy.steps import Steps


class NDParallel(LightningHooks):
    """N-D parallel training of an ordinary LightningModule (every knob: docs/pages/strategy.md, "Knobs").
    After ``connect``, ``strategy.layout`` is the run's `Layout`; ``strategy.config`` stays what was passed.

    Arguments:
        dp_replicate: Copies of the model (HSDP's replicas); each holds every shard FSDP makes inside it.
        dp_shard: Ranks FSDP shards parameters, gradients and optimizer state over; -1 fills the world.
        cp: Context parallelism: ranks each sequence is split over (ring attention).
        tp: Tensor parallelism: ranks each block's layers are split over (+ sequence parallel).
        pp: Pipeline parallelism: ranks the model's blocks are split over, in stages.
        ep: Expert parallelism: ranks a layer's experts are spread over, borrowed from ``dp_shard x cp``.
        zero_stage: What FSDP shards: 3 = params+grads+optimizer (params freed after forward), 2 = params kept from
            forward to backward, 1 = only optimizer state across a gradient-accumulation window. Default: 3, or 2
            under pipeline parallelism (each microbatch would gather the parameters again).
        tp_plan: Explicit TP plan: module-name pattern (``*`` = one component) -> style name or `ParallelStyle`.
        sequence_parallel: Shard the residual stream (norms, dropout) over tp along the sequence: saves activation
            memory.
        loss_parallel: Keep the head's logits sharded over the vocabulary; the loss is computed without gathering
            them.
        block_classes: Classes (or class names) of the repeated blocks; auto-detected when None.
        activation_checkpointing: Recompute activations per block in backward: all of them, or all but
            matmul/attention outputs.
        compile: ``torch.compile`` each block; a string names the backend (True means ``"inductor"``).
        cpu_offload: Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 offload policy).
        pp_schedule: Pipeline schedule: gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv,
            dualpipev.
        pp_microbatches: Microbatches each batch splits into under pp; default 2 x pp. More shrink the bubble.
        pp_stages_per_rank: Stages (virtual stages) per pp rank: 1 for gpipe/1f1b, default 2 for the looped and
            V-shaped schedules.
        pp_layers_per_stage: Blocks per stage, first to last (e.g. [3, 4, 4, 3] for lighter end stages); default:
            balanced by parameters.
        pp_split: Names of the blocks where stages 1, 2, ... start (e.g. ['layers.4']); the alternative to
            pp_layers_per_stage.
        cp_shard_keys: Under cp, the dict-batch entries split along the sequence (dim 1); default: every tensor
            whose dim 1 is the sequence length (the length of the first integer [batch, seq] tensor).
        cp_positions: Under cp, how the model learns its tokens' global positions: ``position_ids`` (its forward
            takes them; the strategy passes them; a model without the argument is refused) or ``model`` (it finds
            them itself, e.g. from ``lightning_nd.context_parallel.region.current_positions()``, or uses none:
            nothing is passed or checked).
        init_on_meta: Build ``configure_model``'s layers on the meta device and materialise only each rank's shards,
            as plain construction makes the model (ties, the constructor's own init), or refuse the run.
        timeout: Collectives after the first step: a rank waiting longer is reported hung (default 5 min).
        init_timeout: Process-group setup and the first step, which may compile or load (default 20 min).
        heartbeat_timeout: A rank silent this long is dead and every other rank stops with the verdict (default 60
            s; None: no watchdog).
        process_group_backend: The torch.distributed backend; None: gloo on CPU, nccl on CUDA.
        async_save: Checkpoint saves during fit return once the state is copied to CPU memory; the write and the
            commit go on in the background (at most one in flight; older checkpoints leave once it commits).
    """

    strategy_name = "nd"

    def __init__(
        self, dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, *,
        zero_stage: Literal[1, 2, 3] | None = None, tp_plan: Mapping[str, object] | None = None,
        sequence_parallel: bool = False, loss_parallel: bool = False, block_classes: Sequence[type | str] | None = None,
        activation_checkpointing: Literal["none", "full", "selective"] = "none", compile: bool | str = False,
        cpu_offload: bool = False, init_on_meta: bool = True,
        pp_schedule: str = "1f1b", pp_microbatches: int | None = None, pp_stages_per_rank: int | None = None,
        pp_layers_per_stage: Sequence[int] | None = None, pp_split: Sequence[str] | None = None,
        cp_shard_keys: Sequence[str] | None = None, cp_positions: Literal["position_ids", "model"] = "position_ids",
        timeout: timedelta | float = STEP_TIMEOUT, init_timeout: timedelta | float = INIT_TIMEOUT,
        heartbeat_timeout: timedelta | float | None = HEARTBEAT_TIMEOUT,
        process_group_backend: str | None = None, async_save: bool = False,
    ) -> None:
        given = {key: value for key, value in locals().items() if key in KEYWORDS}
        silence_internal_warnings()  # before the Trainer that holds this strategy says them
        timeout, init_timeout, heartbeat_timeout = check_timeouts(timeout, init_timeout, heartbeat_timeout)
        super().__init__(save_distributed_checkpoint=True, process_group_backend=process_group_backend,
                         timeout=init_timeout)
        sizes, options, _ = split_arguments(given)
        arguments = read_arguments(sizes, options)
        self.config, self.meta_build = arguments.config, MetaBuild(init_on_meta)
        self.events = EventBus(self)
        self.step_events = StepEvents(self.events)
        self.steps = Steps(self.config, self.step_events)
        self.preflight = Preflight(self.events)
        self.plan = RunPlan(arguments.sizes, self.config, self.events, self.preflight, init_on_meta)
        self.failures = FailureMonitor(timeout, init_timeout, heartbeat_timeout, barrier=self.barrier,
                                       resume_hint=lambda: self.checkpointer.resume_hint(),
                                       on_verdict=self._deliver_verdict)
        if not isinstance(async_save, bool):
            raise TypeError(f"`NDParallel(async_save={async_save!r})` takes True or False.")
        self.checkpointer = Checkpointer(self.events, self.failures, self._checkpointed, self.broadcast, async_save)
        self.auto_resume = AutoResume(self.broadcast, lambda: self.is_global_zero)
        self.requeue = Requeue()

    @classmethod
    def from_config(cls, options: Mapping[str, Any]) -> NDParallel:
        """Build from a mapping (a Hydra ``parallel`` group); an unknown key names the closest valid one."""
        check_keywords(options)
        return cls(**options)

    @property
    def layout(self) -> Layout:
        return self.plan.made

    @property
    def layout_or_none(self) -> Layout | None:
        return self.plan.layout

    @property
    def pipeline_timings(self) -> dict[str, float]:
        """Last step on this rank: ``step_s``, ``compute_s`` (forward/backward), ``idle_s``, ``idle_fraction``."""
        return self.steps.timings
