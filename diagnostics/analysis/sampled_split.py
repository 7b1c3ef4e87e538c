"""A window's live phase means, split by one profiled step: how the `BottleneckMonitor` gets exposed
communication per mesh role without profiling every step.

The live phases (`diagnostics.collect.step_clock`) time every step but cannot see inside a phase. The profiled
step's trace (`diagnostics.analysis.trace.TraceStep`) says which share of each region was compute, the loader,
host time, pipeline idle or communication on which role. Each live phase is divided in the trace's proportions
of its region, so the window keeps its own magnitudes and takes only the proportions from the sampled step (whose
absolute times the profiler inflates). A region the trace lacks keeps its live figure whole.

Live phase -> trace region: ``data_wait`` and ``host`` (what lies between the strategy's phases) -> ``data_wait``;
``forward``, ``backward``, ``optimizer`` -> their own; ``pipeline_idle`` -> ``pipeline``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from diagnostics.records import PHASES, RankTimes

REGIONS = {"data_wait": ("data_wait", "host"), "forward": ("forward",), "backward": ("backward",),
           "optimizer": ("optimizer",), "pipeline": ("pipeline_idle",)}
COMM = "comm:"


def phase_of(region: str, part: str) -> str:
    """The `PHASES` entry a trace part of ``region`` counts under (compute outside the strategy's phases is host;
    inside the pipeline outside a microbatch, pipeline idle)."""
    if part == "loader":
        return "data_wait"
    if part in ("host", "pipeline_idle"):
        return part
    return {"data_wait": "host", "pipeline": "pipeline_idle"}.get(region, region)


def split_window(rank: int, steps: int, live: dict[str, float], trace: Any | None) -> RankTimes:
    """``live``: the window's mean ``step_s`` and live phases; ``trace``: the profiled step (a ``TraceStep``, with
    ``split``: region -> part -> seconds) or None (the live phases stand, communication unmeasured)."""
    phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    comm: dict[str, float] = defaultdict(float)
    for region, live_keys in REGIONS.items():
        total = sum(live.get(key, 0.0) for key in live_keys)
        parts = trace.split.get(region, {}) if trace is not None else {}
        measured = sum(parts.values())
        if measured <= 0:
            for key in live_keys:
                phases[key] += live.get(key, 0.0)
            continue
        for part, seconds in parts.items():
            share = total * seconds / measured
            if part.startswith(COMM):
                comm[part[len(COMM):]] += share
            else:
                phases[phase_of(region, part)] += share
    step = live["step_s"]
    return RankTimes(rank=rank, steps=steps, step_s=step, phases=phases, comm=dict(comm),
                     residual_s=step - sum(phases.values()) - sum(comm.values()))
