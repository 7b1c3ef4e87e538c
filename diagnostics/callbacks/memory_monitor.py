"""`MemoryMonitor`: what filled memory when a rank ran out of it, beside what the cost model expected, and the
changes that would have fitted, priced.

When any rank runs out of memory (`torch.OutOfMemoryError` on CUDA, the CPU allocator's ``can't allocate
memory``), every rank writes ``<dir>/diagnostics/memory-rank<R>.json`` and prints a summary: its parameters,
gradients and optimizer state measured from the live model and optimizer (local shards), activations,
temporaries and non-PyTorch memory from the CUDA allocator (on CPU, which keeps no statistics, unknown beside
the estimate, with the process's peak RSS), the expected figures of `lightning_nd.cost` for the first batch's
shape (`MemoryPlanned`), the parsed error, and the advice ranked by the saving the cost model predicts. Rank
0 adds the TensorBoard card ``diagnostics/memory`` (with the culprit's own card when it is another rank). The
error then propagates and every rank ends (the strategy's failure handling). Every ``log_every_n_steps``
each rank's peak is logged as a scalar: the CUDA allocator's peak, on CPU the model state and the peak RSS (per
rank, and as mean / min / max across ranks for the `TroubleshootingView`'s memory charts).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from diagnostics.analysis.memory import breakdown, rank_advice
from diagnostics.analysis.oom import parse_oom
from diagnostics.callbacks.troubleshooting_view import TroubleshootingView
from diagnostics.collect.gather import gather_floats
from diagnostics.collect.memory import cuda_memory, model_state_bytes, process_memory, snapshot_if_recording
from diagnostics.records import MEMORY_FILE, MemoryReport, from_dict, to_json, write_atomic
from diagnostics.report.memory_card import memory_card, memory_summary
from diagnostics.report.tensorboard import log_text, spread
from lightning_nd.strategy.events import OUT_OF_MEMORY_WORDS

CULPRIT_WAIT_S = 5.0
EXPANDABLE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


class MemoryMonitor(Callback):
    def __init__(self, log_dir: str | None = None, log_every_n_steps: int = 50) -> None:
        """``log_dir``: where ``diagnostics/`` goes (default: the Trainer's ``default_root_dir``).
        ``log_every_n_steps``: how often each rank's peak is logged as a scalar (0: never)."""
        if not isinstance(log_every_n_steps, int) or log_every_n_steps < 0:
            raise ValueError(f"`MemoryMonitor(log_every_n_steps={log_every_n_steps!r})` must be an int >= 0."
                             " HINT: 50, or 0 to log no scalars.")
        self._log_dir, self.every = log_dir, log_every_n_steps
        self.folder: Path | None = None
        self.planned: Any = None
        self.trainer: Trainer | None = None
        self.written = False
        self._logged_step = -1

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Before the strategy's setup: an out-of-memory error while the model is materialised is reported too."""
        self.folder = Path(self._log_dir or trainer.default_root_dir) / "diagnostics"
        self.trainer, self.written = trainer, False
        (self.folder / MEMORY_FILE.format(rank=trainer.global_rank)).unlink(missing_ok=True)
        view = TroubleshootingView.of(trainer)
        if view is not None and self.every:
            kind = "cuda_peak_allocated" if trainer.strategy.root_device.type == "cuda" else "model_state"
            view.margin("memory", f"{kind.replace('_', ' ')} (bytes)", f"memory/{kind}_bytes")
            view.margin("memory", "peak RSS (bytes)", "memory/peak_rss_bytes")
            view.multiline("memory", "per rank (bytes)", [r"memory/.*_bytes/rank\d+"])

    def on_nd_memory_planned(self, strategy: Any, event: Any) -> None:
        self.planned = event

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if not self.every or step % self.every or step == self._logged_step:  # once per optimizer step
            return
        self._logged_step = step
        cuda = cuda_memory(pl_module.device) if pl_module.device.type == "cuda" else None
        state = model_state_bytes(pl_module, trainer.optimizers[0] if trainer.optimizers else None)
        everyone = gather_floats([cuda["peak_allocated"] if cuda else sum(state.values()),
                                  process_memory()["peak_rss_bytes"] or 0], pl_module.device, trainer.world_size)
        kind = "cuda_peak_allocated" if cuda else "model_state"
        metrics = {f"memory/{kind}_bytes/rank{r}": float(v[0]) for r, v in enumerate(everyone)}
        metrics |= {f"memory/peak_rss_bytes/rank{r}": float(v[1]) for r, v in enumerate(everyone) if v[1]}
        metrics |= spread(f"memory/{kind}_bytes", [float(v[0]) for v in everyone])
        if all(v[1] for v in everyone):
            metrics |= spread("memory/peak_rss_bytes", [float(v[1]) for v in everyone])
        for logger in trainer.loggers if trainer.global_rank == 0 else ():
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_nd_out_of_memory(self, strategy: Any, event: Any) -> None:
        self._write(strategy, event.rank, event.message)

    def on_nd_failure_verdict(self, strategy: Any, event: Any) -> None:
        # A peer's own failure, as the watchdog relays it ("failed: OutOfMemoryError: CUDA out of memory ..."); a
        # dead peer's verdict ("died: ... killed, crashed or out of memory") is not one.
        reason = event.reason.lower()
        if not self.written and event.culprit != strategy.global_rank and reason.startswith("failed") and any(
                words in reason for words in OUT_OF_MEMORY_WORDS):
            self._write(strategy, event.culprit, event.reason)

    def _write(self, strategy: Any, culprit: int, message: str) -> None:
        if self.written or self.folder is None or self.trainer is None:
            return
        self.written = True
        trainer, rank = self.trainer, strategy.global_rank
        report = self._report(strategy, trainer, rank, culprit, message)
        write_atomic(self.folder / MEMORY_FILE.format(rank=rank), to_json(report))
        print(memory_summary(report), flush=True)
        if rank == 0:
            card = memory_card(report)
            if culprit != rank:
                theirs = _wait_for(self.folder / MEMORY_FILE.format(rank=culprit))
                card = (memory_card(theirs) + "\n\n---\n\n" + card) if theirs is not None else card
            log_text(trainer, "diagnostics/memory", card)

    def _report(self, strategy: Any, trainer: Trainer, rank: int, culprit: int, message: str) -> MemoryReport:
        module = strategy.lightning_module
        state = model_state_bytes(module, trainer.optimizers[0] if trainer.optimizers else None)
        device = module.device
        cuda = cuda_memory(device) if device.type == "cuda" else None
        if cuda is not None:
            snapshot_if_recording(self.folder / f"memory-snapshot-rank{rank}.pickle")
        rss = process_memory()["peak_rss_bytes"]
        measured = {"params": state["params"], "grads": state["grads"],
                    "optimizer": state["optimizer"] + state["optimizer_steps"], "activations": None,
                    "temporaries": None, "non_pytorch": cuda["non_pytorch"] if cuda else None,
                    "total": cuda["peak_allocated"] if cuda else rss}
        # The allocator knows tensors, not what they are for: activations and temporaries are in its total only.
        sources = {"params": "local shards", "grads": "local shards", "optimizer": "local shards",
                   "activations": "in the CUDA total" if cuda else "unknown on CPU",
                   "temporaries": "in the CUDA total" if cuda else "unknown on CPU",
                   "non_pytorch": "CUDA: device used - reserved" if cuda else "unknown on CPU",
                   "total": "CUDA allocator peak" if cuda else "process peak RSS"}
        planned = self.planned
        expected = planned.expected if planned is not None else {}
        oom = parse_oom(message)
        notes = [] if planned is not None else ["No expectation: the run failed before its first batch was priced."]
        advice = ()
        if planned is not None:
            candidates = [(a["action"], _overrides(a, planned.workload), a["peak_bytes"], a["detail"])
                          for a in planned.alternatives]
            if oom.reserved_unallocated_bytes:
                candidates.append((EXPANDABLE, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                                   planned.peak["peak_bytes"] - oom.reserved_unallocated_bytes,
                                   "reserved but unallocated memory is fragmentation the allocator can reclaim"))
            advice = rank_advice(planned.peak["peak_bytes"], candidates)
        layout = strategy.layout_or_none
        return MemoryReport(
            rank=rank, step=trainer.global_step, culprit=culprit, device=str(device),
            capacity_bytes=cuda["capacity"] if cuda else None, oom=oom,
            figures=breakdown(measured, {"params": expected.get("params_bytes"), "grads": expected.get("grads_bytes"),
                                         "optimizer": expected.get("optimizer_bytes"),
                                         "activations": expected.get("activations_bytes"),
                                         "temporaries": expected.get("temporaries_bytes"), "non_pytorch": None,
                                         "total": expected.get("peak_bytes")}, sources),
            advice=advice, dims=dict(layout.dims) if layout else {}, options=layout.options.to_dict() if layout else {},
            notes=tuple(notes))


def _overrides(alternative: dict, workload: dict) -> dict[str, Any]:
    """What to pass to run the alternative: `NDParallel` keywords, and the batch and accumulation when they change."""
    change = {**alternative["options"], **(alternative["sizes"] or {})}
    if alternative["batch"] != workload["batch"]:
        change["batch_size"] = alternative["batch"]
    if alternative["accumulation"] != workload["accumulation"]:
        change["accumulate_grad_batches"] = alternative["accumulation"]
    return change


def _wait_for(path: Path) -> MemoryReport | None:
    import json

    deadline = time.monotonic() + CULPRIT_WAIT_S
    while time.monotonic() < deadline:
        if path.is_file():
            return from_dict(MemoryReport, json.loads(path.read_text()))
        time.sleep(0.1)
    return None

