"""`ProfiledStep`: the `BottleneckMonitor`'s one profiled step per window, started, stopped and its trace taken.

The step runs under `torch.profiler` (CPU; CUDA too on a GPU), unless a profiler already records (the user's own,
or Lightning's: one at a time). Stopped, a CPU trace is taken from the profiler's results in memory
(`diagnostics.collect.profiler_events`), which spares writing and reading ~10,000 events per window; one with device
events is exported and read back. The last profiled step's trace is written to ``<folder>/rank<R>.json`` by
`write_last`, at the end of a fit or when it fails, for ``python -m diagnostics trace``. Kineto's console notes
around start and stop are dropped (`diagnostics.collect.profiler_notes`). No failure here stops the run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from diagnostics.collect.profiler_events import in_memory_trace
from diagnostics.collect.profiler_notes import without_profiler_notes
from lightning_nd.runtime.profiling import recording

log = logging.getLogger("lightning_nd")


class ProfiledStep:
    def __init__(self) -> None:
        self.step: int | None = None
        """The optimizer step that was (or is being) profiled last."""
        self._profiler: Any = None
        self._last: Any = None

    @property
    def running(self) -> bool:
        return self._profiler is not None

    def start(self, device: torch.device, step: int) -> None:
        if recording():
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)
        try:
            with without_profiler_notes():
                profiler.__enter__()
        except RuntimeError as error:
            log.warning("lightning-nd BottleneckMonitor: no profiled step this window: %s", error)
            return
        self._profiler, self.step = profiler, step

    def stop(self, folder: Path, rank: int) -> dict | None:
        """Stop the profiler; its trace (``{"traceEvents": [...]}``), or None when none could be taken."""
        profiler = self._stopped()
        if profiler is None:
            return None
        try:
            trace = in_memory_trace(profiler)
            self._last = profiler if trace is not None else None
            if trace is None:
                with open(_export(profiler, folder, rank), encoding="utf-8") as text:
                    trace = json.load(text)
            return trace
        except Exception as error:  # noqa: BLE001 - a diagnostic never stops the run
            log.warning("lightning-nd BottleneckMonitor: the profiled step's trace was not taken: %s", error)
            return None

    def drop(self) -> None:
        """Stop a running profiler without analysing it (the fit ends or fails)."""
        self._stopped()

    def write_last(self, folder: Path, rank: int) -> None:
        """The last step taken in memory, its trace written as ``<folder>/rank<R>.json`` (once: it is then forgotten)."""
        profiler, self._last = self._last, None
        if profiler is not None:
            try:
                _export(profiler, folder, rank)
            except Exception as error:  # noqa: BLE001 - a diagnostic never stops the run
                log.warning("lightning-nd BottleneckMonitor: the last profiled step's trace was not written: %s",
                            error)

    def forget(self) -> None:
        self._last, self.step = None, None

    def _stopped(self) -> Any:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            with without_profiler_notes():
                profiler.__exit__(None, None, None)
        return profiler


def _export(profiler: Any, folder: Path, rank: int) -> Path:
    path = folder / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(path))
    return path
