"""`RunSummary`: what a sweep compares, one ``<log_dir>/diagnostics/run.json`` per run (`RunRecord`).

At the end of fit: the layout, tokens per second over the batch ranks and the measured step (the steps after the
first, median), the global batch, each rank's peak memory (one gather), the last bottleneck window's class, the first
and the final loss, and what
the planner's cost model predicts for this layout and the first batch (the strategy's `MemoryPlanned` event, the
step time on the hardware preset the device matches, or priced by a host's measured profile when one is given). On a failure: refused, out of memory, hang or crash, with
the error (rank 0 writes; no collective is called, the process group may be broken). A job that fails before any
Trainer exists (a layout refused when the strategy is built) writes its record with `write_failure`.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from diagnostics.analysis.outcome import classify, reason
from diagnostics.collect.gather import gather_floats
from diagnostics.collect.host import device_preset
from diagnostics.collect.memory import process_memory
from diagnostics.records import (
    BOTTLENECK_FILE,
    HANG_FILE,
    RUN_FILE,
    HangReport,
    RunRecord,
    from_dict,
    read_windows,
    to_json,
    write_atomic,
)
from lightning_nd.cost.hardware import parse_hardware
from lightning_nd.cost.layout_cost import cost_layout
from lightning_nd.cost.op_count import OpCount, count_model_ops
from lightning_nd.cost.profile import HostProfile
from lightning_nd.cost.shape import Workload
from lightning_nd.model.batch import token_shape, whole_tokens
from lightning_nd.runtime.errors import exception_chain

log = logging.getLogger(__name__)
CRASHED = ("dead", "failed")
"""Hang-verdict culprit kinds that mean the rank crashed (died, or its own step raised) rather than hung."""
COST_OPTIONS = ("zero_stage", "activation_checkpointing", "pp_schedule", "pp_microbatches", "sequence_parallel")


def _chain(error: BaseException) -> tuple[tuple[str, ...], str]:
    """Class names (with bases) and messages of the error and of those it was raised from."""
    chain = exception_chain(error)
    return tuple(cls.__name__ for link in chain for cls in type(link).__mro__), "\n".join(map(str, chain))


class RunSummary(Callback):
    def __init__(self, log_dir: str | None = None, overrides: Sequence[str] = (), hardware: str | None = None,
                 profile: str | None = None) -> None:
        """``log_dir``: where ``diagnostics/run.json`` goes (default: the Trainer's ``default_root_dir``).
        ``overrides``: the job's command-line overrides (the row's name and the line that repeats it).
        ``hardware``: the cost model's preset for the predicted step time (default: ``cpu`` on CPU, the preset
        the CUDA device's name matches, else none). ``profile``: a host profile file (``python -m lightning_nd.plan
        --calibrate`` writes one) that prices the step instead, with the model's operations counted at setup."""
        if hardware is not None:
            parse_hardware(hardware)  # a bad name fails here, with its HINT
        if hardware is not None and profile is not None:
            raise ValueError(f"`RunSummary(hardware={hardware!r}, profile={profile!r})`: both price the predicted"
                             " step. HINT: pass one.")
        self.profile = HostProfile.load(Path(profile)) if profile is not None else None  # a bad file fails here
        self._log_dir, self.overrides, self.hardware = log_dir, tuple(overrides), hardware
        self.ops: OpCount | None = None
        self.layout: Any = None
        self.shape: Any = None
        self.planned: Any = None
        self.verdict: Any = None
        self._ends: list[float] = []
        self._tokens: list[int] = []
        self._seen, self._step = 0, 0
        self._samples: int | None = None
        self._first_losses: list[float] = []
        self._first_loss: float | None = None
        self._failure: tuple[BaseException, Trainer | None] | None = None
        self._started: float | None = None
        self._trainer: Trainer | None = None
        self._writing = threading.RLock()

    def folder(self, trainer: Trainer | None = None) -> Path:
        root = self._log_dir or (trainer.default_root_dir if trainer is not None else ".")
        return Path(root) / "diagnostics"

    def on_nd_layout_ready(self, strategy: Any, event: Any) -> None:
        if self.profile is not None and event.model is not None and strategy.global_rank == 0:
            self.ops = count_model_ops(event.model)

    def on_nd_layout_applied(self, strategy: Any, event: Any) -> None:
        self.layout, self.shape = event.layout, event.shape

    def on_nd_memory_planned(self, strategy: Any, event: Any) -> None:
        self.planned = event

    def on_nd_failure_verdict(self, strategy: Any, event: Any) -> None:
        """The run's verdict (which rank failed and why) comes after the callbacks' ``on_exception``: the record
        written then is written again with it."""
        self.verdict = event
        with self._writing:
            failure = self._failure
            if failure is None and self._trainer is not None and self._trainer.global_rank == 0:
                # The watchdog's verdict while this rank's own step still waits (it ends the process next).
                failure = (RuntimeError(f"rank {event.culprit}: {event.reason}"), self._trainer)
            if failure is not None:
                self._write_failure(*failure, stand_in=self._failure is None)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._started, self._trainer = time.time(), trainer
        if stage == "fit" and trainer.global_rank == 0:
            (self.folder(trainer) / RUN_FILE).unlink(missing_ok=True)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        seen = whole_tokens(batch, self.layout.dims["cp"] if self.layout is not None else 1)
        if seen is not None:
            self._seen += seen[0]
        shape = token_shape(batch)
        if self._samples is None and shape is not None:
            self._samples = shape[0]

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        if self._first_loss is None and loss is not None:
            self._first_losses.append(float(loss))  # each batch of the first step (more when accumulating)
        if trainer.global_step == self._step:  # accumulating: the optimizer has not stepped
            return
        if self._first_loss is None and self._first_losses:
            self._first_loss = statistics.mean(self._first_losses)
        self._step = trainer.global_step
        self._ends.append(time.perf_counter())
        self._tokens.append(self._seen)
        self._seen = 0

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        cuda = pl_module.device.type == "cuda"
        if cuda:
            import torch

            mine = float(torch.cuda.max_memory_allocated(pl_module.device))
        else:
            mine = float(process_memory()["peak_rss_bytes"] or 0)
        peaks = [values[0] for values in gather_floats([mine], pl_module.device, trainer.world_size)]
        if trainer.global_rank != 0:
            return
        try:
            record = self._record(trainer, pl_module, peaks, "cuda_peak_allocated" if cuda else "peak_rss")
            write_atomic(self.folder(trainer) / RUN_FILE, to_json(record))
        except Exception as error:  # noqa: BLE001 - a diagnostic never stops the run
            log.warning("lightning-nd RunSummary: no run record written: %s", error)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if trainer.global_rank == 0:
            self.write_failure(exception, trainer)

    @property
    def recorded(self) -> bool:
        """Whether a failure of this run has been recorded."""
        return self._failure is not None

    def write_failure(self, error: BaseException, trainer: Trainer | None = None) -> RunRecord:
        with self._writing:  # the main thread's error and the watchdog thread's verdict may come at once
            return self._write_failure(error, trainer, stand_in=False)

    def _write_failure(self, error: BaseException, trainer: Trainer | None, stand_in: bool) -> RunRecord:
        """Rank 0's record of a failed run; ``trainer`` None: it failed before one existed (nothing stepped). A
        hang verdict (`CollectiveMonitor`'s ``hang.json``, from this run) names the culprit: a rank that died or
        failed by itself makes it a crash, any other culprit a hang; else the error (and the run's failure
        verdict) is classified."""
        if not stand_in:  # the stand-in for a verdict never replaces a real error (it is rewritten with it)
            self._failure = (error, trainer)
        names, message = _chain(error)
        verdict = self.verdict
        if verdict is not None and verdict.culprit != getattr(trainer, "global_rank", 0):
            message = f"rank {verdict.culprit}: {verdict.reason}\n{message}"
        steps = trainer.global_step if trainer is not None else 0
        status = classify(names, message, steps > 0)
        said = reason(type(error).__name__, message if verdict is None else message.split("\n", 1)[0])
        hang = self._hang_report(trainer)
        if status != "oom" and hang is not None and hang.culprits and hang.summary:
            status = "crash" if hang.culprits[0].kind in CRASHED else "hang"
            said = hang.summary[0]
        record = RunRecord(status, said, self.overrides, *self._layout_fields(), steps=steps)
        try:
            write_atomic(self.folder(trainer) / RUN_FILE, to_json(record))
        except OSError as problem:
            log.warning("lightning-nd RunSummary: no run record written: %s", problem)
        return record

    def _hang_report(self, trainer: Trainer | None) -> HangReport | None:
        path = self.folder(trainer) / HANG_FILE
        try:
            if self._started is None or path.stat().st_mtime < self._started:
                return None  # none, or an earlier run's
            return from_dict(HangReport, json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _layout_fields(self) -> tuple[dict[str, int], dict[str, Any]]:
        if self.layout is None:
            return {}, {}
        options = self.layout.options.to_dict()
        return dict(self.layout.dims), {key: options[key] for key in COST_OPTIONS if key in options}

    def _record(self, trainer: Trainer, pl_module: LightningModule, peaks: list[float], kind: str) -> RunRecord:
        intervals = [b - a for a, b in zip(self._ends, self._ends[1:])]
        step_s = statistics.median(intervals) if intervals else None
        dims = self.layout.dims if self.layout is not None else {}
        batch_ranks = dims.get("dp_replicate", 1) * dims.get("dp_shard", 1) if dims else trainer.world_size
        tokens = statistics.median(self._tokens[1:]) * batch_ranks if len(self._tokens) > 1 else None
        loss = trainer.callback_metrics.get("train_loss")
        predicted_step, predicted_peak, hardware = self._prediction(trainer, pl_module)
        global_batch = self._samples * batch_ranks * trainer.accumulate_grad_batches if self._samples else None
        return RunRecord(
            "ok", "", self.overrides, *self._layout_fields(), steps=trainer.global_step, global_batch=global_batch,
            first_loss=self._first_loss, final_loss=float(loss) if loss is not None else None,
            tokens_per_s=tokens / step_s if tokens and step_s else None, step_s=step_s, peak_bytes=tuple(peaks),
            memory_kind=kind, bottleneck=self._bottleneck(trainer), predicted_step_s=predicted_step,
            predicted_peak_bytes=predicted_peak, hardware=hardware)

    def _prediction(self, trainer: Trainer,
                    pl_module: LightningModule) -> tuple[float | None, float | None, str | None]:
        planned = self.planned
        if planned is None:
            return None, None, None
        name = device_preset(pl_module.device, self.hardware)
        step = None
        if (name is not None or self.profile is not None) and self.layout is not None and self.shape is not None:
            cost = cost_layout(self.layout, self.shape, Workload(**planned.workload), optimizer=planned.optimizer,
                               hardware=parse_hardware(name) if name else None, gpus_per_node=trainer.num_devices,
                               profile=self.profile, ops=self.ops)
            step = cost.time.total_s if cost.time is not None else None
            name = cost.time.priced_by if cost.time is not None else name
        return step, float(planned.peak["peak_bytes"]), name

    def _bottleneck(self, trainer: Trainer) -> str | None:
        path = self.folder(trainer) / BOTTLENECK_FILE
        windows = read_windows(path.read_text()) if path.is_file() else []
        return windows[-1].diagnosis.label if windows else None
