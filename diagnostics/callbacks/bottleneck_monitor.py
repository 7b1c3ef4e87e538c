"""`BottleneckMonitor`: why the steps are slow, classified live across ranks every window of steps.

Every step each rank times its phases (`diagnostics.collect.step_clock`, from the strategy's `StepPhase` and
`StageTiming` events). The last step of each window runs under `torch.profiler` (CPU; CUDA too on a GPU); its trace
(`diagnostics.analysis.trace`) splits every phase into compute, the loader, host time and exposed communication
per mesh role, in proportions applied to the window's means (`diagnostics.analysis.sampled_split`). The ranks'
figures meet in one all-gather; rank 0 classifies the window (`diagnostics.analysis.bottleneck.classify`, or your
own ``classifier``) and writes:

- ``<log_dir>/diagnostics/bottleneck.jsonl``: one line per window (`diagnostics.records.WindowRecord`);
- TensorBoard: ``bottleneck/<phase>_s`` and ``bottleneck/comm_<role>_s`` as mean / min / max across ranks, the
  throughput over the batch ranks (``throughput/tokens_per_s``, ``throughput/mfu``), the card
  ``diagnostics/bottleneck`` and the figure ``diagnostics/step_phases``; with a `TroubleshootingView`, the charts;
- the console: one line whenever the diagnosis changes.

The first step of a fit (warm-up) and the profiled step (the profiler slows it) are left out of the means.
Validation loops and checkpoint saves are not counted in any step. A CPU trace is analysed from the profiler's
results in memory (`diagnostics.collect.profiled_step`); the last profiled step's trace is written at the end of
the fit (or when it fails) to ``<log_dir>/diagnostics/traces/rank<R>.json`` for ``python -m diagnostics trace``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from diagnostics.analysis.bottleneck import attribute_waiting, classify
from diagnostics.analysis.sampled_split import split_window
from diagnostics.analysis.trace import TraceStep, trace_steps
from diagnostics.callbacks.troubleshooting_view import TroubleshootingView
from diagnostics.collect.gather import gather_floats
from diagnostics.collect.host import device_preset, host_processors, host_shares
from diagnostics.collect.profiled_step import ProfiledStep
from diagnostics.collect.step_clock import StepClock, mean_row
from diagnostics.collect.window_vector import rank_times_of, sequence_length_of, tokens_of, window_vector
from diagnostics.records import BOTTLENECK_FILE, PHASES, RankTimes, WindowContext, WindowRecord, to_json, write_atomic
from diagnostics.report.bottleneck_card import bottleneck_markdown, bottleneck_summary, step_phase_figure
from diagnostics.report.tensorboard import log_figure, log_text, spread
from lightning_nd.cost.hardware import parse_hardware
from lightning_nd.cost.shape import ModelShape
from lightning_nd.cost.step_time import flops_per_token
from lightning_nd.model.batch import whole_tokens

log = logging.getLogger("lightning_nd")

CHARTED_ROLES = ("pp", "dp_replicate", "cp", "tp", "fsdp", "loss", "ep")
"""The roles the trace's analysis gives communication to (`analysis/trace_timeline.py`), charted when the run has
them; ``batch``, ``dp_shard``, ``hsdp`` are the ranks of ``fsdp`` or ``dp_replicate``: their charts would stay empty."""


class BottleneckMonitor(Callback):
    def __init__(self, log_dir: str | None = None, every_n_steps: int = 50, profile: bool = True,
                 classifier: Callable[..., Any] | None = None, hardware: str | None = None) -> None:
        """``every_n_steps``: the window, in optimizer steps (>= 2 when profiling: one step of each is profiled).
        ``profile``: split communication out with one profiled step per window (False: phases only).
        ``classifier``: ``(ranks, context) -> Diagnosis`` instead of `classify` (e.g. ``functools.partial(classify,
        thresholds=Thresholds(data_share=0.1))``). ``hardware``: a `lightning_nd.cost.hardware` preset for MFU
        (``h100``, ``a100``, ``cpu``...; default: from the CUDA device's name, ``cpu`` on CPU, none otherwise)."""
        if not isinstance(every_n_steps, int) or every_n_steps < (2 if profile else 1):
            raise ValueError(f"`BottleneckMonitor(every_n_steps={every_n_steps!r})` must be an int >= "
                             f"{2 if profile else 1}. HINT: 50; with `profile=True` one step per window is profiled.")
        if hardware is not None:
            parse_hardware(hardware)  # a wrong name fails now, with the presets named
        self._log_dir, self.every, self.profile, self.hardware = log_dir, every_n_steps, profile, hardware
        self.classifier = classifier or classify
        self.clock = StepClock()
        self.layout: Any = None
        self.shape: ModelShape | None = None
        self.records: list[WindowRecord] = []
        self.folder: Path | None = None
        self.profiled = ProfiledStep()
        self._trace_step: Any = None
        self._tokens = [0, 0]  # tokens this rank saw in the window, and the full sequence length
        self._hosts: dict[int, str] = {}
        self._host_cores: dict[str, int] = {}
        self._shared_gpus: dict[str, tuple[int, ...]] = {}
        self._closed = -1
        self._first_step = self._window_end = 0
        self._last_step: int | None = None
        self._validation_start = 0.0

    # ---- set-up --------------------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.folder = Path(self._log_dir or trainer.default_root_dir) / "diagnostics"
        self.records, self._closed, self._trace_step = [], -1, None
        self.profiled.forget()
        # An earlier fit's windows are not this one's; a later validate or test leaves them.
        if trainer.global_rank == 0 and stage == "fit":
            (self.folder / BOTTLENECK_FILE).unlink(missing_ok=True)

    def on_nd_layout_ready(self, strategy: Any, event: Any) -> None:
        self.layout = event.layout
        if strategy.global_rank == 0:  # beside the traces, for `python -m diagnostics trace`
            write_atomic(self.folder / "layout.json", event.layout.to_json(indent=1))
        view = TroubleshootingView.of(strategy.lightning_module.trainer)
        if view is None:
            return
        view.margin("step", "step time (s)", "bottleneck/step_s")
        for phase in PHASES:
            view.margin("step", f"{phase} (s)", f"bottleneck/{phase}_s")
        view.margin("step", "residual (s)", "bottleneck/residual_s")
        view.multiline("communication", "exposed, mean across ranks (s)", [r"bottleneck/comm_.*_s/mean"])
        for role, groups in sorted(event.layout.roles.items()):
            if role in CHARTED_ROLES and groups and len(groups[0]) > 1:
                view.margin("communication", f"{role} (s)", f"bottleneck/comm_{role}_s")
        view.multiline("throughput", "tokens/s over the batch ranks", ["throughput/tokens_per_s"])
        view.multiline("throughput", "MFU", ["throughput/mfu"])

    def on_nd_layout_applied(self, strategy: Any, event: Any) -> None:
        self.shape = event.shape  # read before the composer split the model: the MFU's FLOPs per token

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        mine = host_processors(pl_module.device)
        places = [mine] * trainer.world_size
        if dist.is_initialized():
            dist.all_gather_object(places, mine)
        self._hosts, self._host_cores, self._shared_gpus = host_shares(places)
        self._first_step = self._window_end = self._closed = trainer.global_step  # after a resume: its step
        total = trainer.estimated_stepping_batches  # the fit's last optimizer step (inf when unknown)
        self._last_step = int(total) if math.isfinite(total) else None
        self.clock.begin(time.perf_counter())

    # ---- every step ----------------------------------------------------------------------------------------

    def on_nd_step_phase(self, strategy: Any, event: Any) -> None:
        self.clock.phase(event)

    def on_nd_stage_timing(self, strategy: Any, event: Any) -> None:
        self.clock.stage(event)

    def on_nd_checkpoint_saved(self, strategy: Any, event: Any) -> None:
        now = time.perf_counter()
        self.clock.exclude(now - event.seconds, now)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.clock.exclude(self._validation_start, time.perf_counter())

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        seen = whole_tokens(batch, self.layout.dims["cp"] if self.layout is not None else 1)
        if seen is not None:
            self._tokens[0] += seen[0]
            self._tokens[1] = seen[1]

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self._closed:  # accumulating: the optimizer has not stepped
            return
        self._closed = step
        now = time.perf_counter()
        if self.profiled.running:
            self._trace_step = self._analysed(self.profiled.stop(self.folder / "traces", trainer.global_rank))
        row = self.clock.close(now)
        if row is not None and (step - self._first_step == 1 or step == self.profiled.step):
            self.clock.rows.pop()  # warm-up, or slowed by the profiler
        if step % self.every == 0 and step > self._window_end:
            self._close_window(trainer, pl_module, step)
        if self.profile and ((step + 1) % self.every == 0 or self._ends_a_short_window(step + 1)):
            self.profiled.start(pl_module.device, step + 1)
        self.clock.begin(time.perf_counter())  # the window's own work is no step's

    def _ends_a_short_window(self, step: int) -> bool:
        """The run's last step closes a window shorter than ``every_n_steps`` (a short run, or its tail) with a step
        left to measure besides it: profiled too, so that window's communication is split out as well."""
        return step == self._last_step and step - max(self._window_end, self._first_step + 1) >= 2

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.profiled.drop()
        self.profiled.write_last(self.folder / "traces", trainer.global_rank)
        if self.clock.rows:
            self._close_window(trainer, pl_module, trainer.global_step)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.profiled.drop()  # never left recording: a later fit in this process could not start its own
        self.profiled.write_last(self.folder / "traces", trainer.global_rank)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.profiled.drop()

    def _analysed(self, trace: dict | None) -> TraceStep | None:
        try:
            steps = trace_steps(trace, self.layout.dims if self.layout is not None else None) if trace else []
        except Exception as error:  # noqa: BLE001 - a diagnostic never stops the run
            log.warning("lightning-nd BottleneckMonitor: the profiled step was not analysed: %s", error)
            return None
        return steps[0] if steps else None

    # ---- the window ----------------------------------------------------------------------------------------

    def _close_window(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        rows = self.clock.take()
        mine = split_window(trainer.global_rank, len(rows), mean_row(rows), self._trace_step) if rows else None
        profiled = self._trace_step is not None
        everyone = gather_floats(window_vector(mine, self._tokens), pl_module.device, trainer.world_size)
        first, self._window_end = self._window_end + 1, step
        self._tokens, self._trace_step = [0, self._tokens[1]], None
        ranks = [times for r, values in enumerate(everyone) if (times := rank_times_of(r, values)) is not None]
        if trainer.global_rank == 0 and ranks:
            try:
                self._report(trainer, pl_module, ranks, everyone, first, step, profiled)
            except Exception as error:  # noqa: BLE001 - a diagnostic never stops the run
                log.warning("lightning-nd BottleneckMonitor: window ending at step %d not classified: %s", step, error)
        if dist.is_initialized():
            dist.barrier()  # rank 0's report is no rank's step: the others would wait for it in their next one

    def _report(self, trainer: Trainer, pl_module: LightningModule, ranks: list[RankTimes], vectors: list[list[float]],
                first: int, last: int, profiled: bool) -> None:
        layout = self.layout
        roles = layout.roles if layout is not None else {}
        step_s = sum(r.step_s for r in ranks) / len(ranks)
        batch_ranks = layout.dims["dp_replicate"] * layout.dims["dp_shard"] if layout is not None else 1
        tokens = sum(tokens_of(v) for v in vectors) * batch_ranks / trainer.world_size / (last - first + 1)
        tokens_per_s = tokens / step_s if step_s > 0 and tokens > 0 else None
        context = WindowContext(
            first_step=first, last_step=last, dims=dict(layout.dims) if layout is not None else {}, roles=roles,
            pp_schedule=layout.options.pp_schedule if layout is not None else None,
            pp_microbatches=layout.options.pp_microbatches if layout is not None else None,
            pp_stages_per_rank=layout.options.pp_stages_per_rank if layout is not None else 1,
            num_workers=getattr(trainer.train_dataloader, "num_workers", None), hosts=self._hosts,
            profiled=profiled,
            host_cores=self._host_cores, shared_gpus=self._shared_gpus,
            tokens_per_s=tokens_per_s, mfu=self._mfu(trainer, pl_module, tokens_per_s, sequence_length_of(vectors[0])),
            options={**(layout.options.to_dict() if layout is not None else {}), "precision": str(trainer.precision)})
        diagnosis = self.classifier(ranks, context)  # it sees each collective's wait still inside it
        record = WindowRecord(context=context, ranks=attribute_waiting(ranks, roles), diagnosis=diagnosis)
        self._write(trainer, record, profiled=any(r.comm for r in ranks))

    def _write(self, trainer: Trainer, record: WindowRecord, profiled: bool) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / BOTTLENECK_FILE, "a") as out:
            out.write(to_json(record, indent=None) + "\n")
        metrics = spread("bottleneck/step_s", [r.step_s for r in record.ranks])
        metrics |= spread("bottleneck/residual_s", [r.residual_s for r in record.ranks])
        for phase in PHASES:
            metrics |= spread(f"bottleneck/{phase}_s", [r.phases.get(phase, 0.0) for r in record.ranks])
        for role in sorted({role for r in record.ranks for role in r.comm}):
            metrics |= spread(f"bottleneck/comm_{role}_s", [r.comm.get(role, 0.0) for r in record.ranks])
        if record.context.tokens_per_s is not None:
            metrics["throughput/tokens_per_s"] = record.context.tokens_per_s
        if record.context.mfu is not None:
            metrics["throughput/mfu"] = record.context.mfu
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        log_text(trainer, "diagnostics/bottleneck", bottleneck_markdown(record, profiled))
        log_figure(trainer, "diagnostics/step_phases", step_phase_figure(record.ranks))
        if not self.records or self.records[-1].diagnosis.label != record.diagnosis.label:
            print(bottleneck_summary(record), flush=True)
        self.records.append(record)

    def _mfu(self, trainer: Trainer, pl_module: LightningModule, tokens_per_s: float | None, seq_len: int) -> float | None:
        shape, name = self.shape, device_preset(pl_module.device, self.hardware)
        if shape is None or name is None or not tokens_per_s or not seq_len:
            return None
        peak = parse_hardware(name).peak_flops * trainer.world_size
        return flops_per_token(shape, seq_len) * tokens_per_s / peak
