"""A `torch.profiler` trace (Kineto's chrome-trace JSON) -> where each step's time went: per region (forward,
backward, optimizer, pipeline, data_wait), compute, the loader, host time, pipeline idle and exposed communication
per mesh role; `rank_times` turns that into the bottleneck contract's `RankTimes`.

Regions come from the main thread's innermost phase label (`diagnostics.analysis.trace_timeline`): our
``nd::phase::*`` and ``nd::pipeline``, or in a plain trace without them torch's own labels
(`trace_timeline.fallback_phases`). A step is a ``ProfilerStep#N`` (``torch.profiler.schedule`` with
``prof.step()``); without one, the main thread's whole span is one step (the `BottleneckMonitor`'s trace).

CPU traces (gloo): a collective blocks the main thread, so the main thread's time inside a communication event is
exposed: ops named ``c10d::``, ``_c10d_functional::``, ``record_param_comms``, ``nccl:``, and the regions
``FSDP::*`` and ``nd::comm::*``, counted whole (FSDP2's ``work.wait()`` and its copies in and out of the
all-gather buffer show as their own time, not as an op). Every instant is in exactly one part, so the parts of a
step sum to its time. GPU traces (CUDA events present): what the device ran, `diagnostics.analysis.trace_gpu`.

Pure: stdlib only, no Lightning, no process group; fast enough to run inside training on one step's trace.
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path

from diagnostics.analysis.nccl_log import rank_from_name
from diagnostics.analysis.sampled_split import COMM, phase_of
from diagnostics.analysis.trace_gpu import device_events, device_split
from diagnostics.analysis.trace_timeline import (
    OUTSIDE,
    PHASE,
    PIPELINE,
    STEP,
    Labeller,
    State,
    cpu_part,
    fallback_phases,
    main_thread,
    sorted_events,
    thread_events,
    timeline,
)
from diagnostics.records import PHASES, RankTimes
from diagnostics.records.bounds import loads, read_bytes

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
MESH_DIMS = DIMS[:5]
_HINT = ("HINT: export one with `prof.export_chrome_trace('trace.json')` (or `.json.gz`) or "
         "`torch.profiler.tensorboard_trace_handler`.")


@dataclass(frozen=True)
class TraceStep:
    """One step of one rank's trace."""

    step: int | None
    """``N`` of ``ProfilerStep#N``; None when the trace has no ProfilerStep (the main thread's span is the step)."""
    step_s: float
    """Its wall time: the ``ProfilerStep#N``'s duration."""
    split: dict[str, dict[str, float]]
    """region -> part -> seconds; the parts of all regions sum to step_s (the step is tiled). Regions:
    ``forward``, ``backward``, ``optimizer``, ``pipeline`` (inside ``nd::pipeline``, outside its microbatches),
    ``data_wait`` (in no phase: the loader, Lightning's hooks). Parts: ``compute``, ``loader``, ``host``,
    ``pipeline_idle``, ``comm:<role>``."""


def read_trace(path: Path) -> dict:
    """A trace file, ``.json`` or ``.json.gz``; ValueError naming it when it is not a Kineto trace."""
    path = Path(path)
    try:
        trace = loads(read_bytes(path), path)  # bounded, also once decompressed
    except (ValueError, EOFError, OSError, zlib.error) as error:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path} is not a torch.profiler trace: it does not read as JSON ({error}). {_HINT}"
                         ) from error
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path} is JSON but not a torch.profiler trace: it has no `traceEvents` list. {_HINT}")
    wrong = next((index for index, event in enumerate(trace["traceEvents"]) if not _is_event(event)), None)
    if wrong is not None:
        raise ValueError(f"{path} is JSON but not a torch.profiler trace: event {wrong} is"
                         f" {str(trace['traceEvents'][wrong])[:120]}. {_HINT}")
    return trace


EVENT_FIELDS = {"name": str, "ph": str, "cat": str, "args": dict}
NUMBER_FIELDS = ("ts", "dur")


def _is_event(event: object) -> bool:
    """A Kineto event as the analysis reads it: its fields, where present, of their types (numbers finite)."""
    if not isinstance(event, dict):
        return False
    if any(key in event and not isinstance(event[key], kind) for key, kind in EVENT_FIELDS.items()):
        return False
    return all(isinstance(event[key], (int, float)) and not isinstance(event[key], bool) and math.isfinite(event[key])
               for key in NUMBER_FIELDS if key in event)


def trace_rank(trace: dict) -> int | None:
    """The global rank that wrote the trace (torch records it when a process group is initialised)."""
    rank = (trace.get("distributedInfo") or {}).get("rank")
    return rank if isinstance(rank, int) else None


def find_traces(folder: Path) -> dict[int, list[Path]]:
    """Rank -> every trace (``*.json``, ``*.json.gz``, torch's ``*.pt.trace.json[.gz]`` included) under
    ``folder``, by the rank in its ``distributedInfo``, else a ``rank<N>`` in its name, else rank 0 when it is
    the only trace. Other JSON files are skipped; ValueError when no trace is found or one's rank is unknown."""
    folder = Path(folder)
    ranks: dict[int, list[Path]] = defaultdict(list)
    unranked = []
    for path in sorted(p for p in folder.rglob("*") if p.name.endswith((".json", ".json.gz")) and p.is_file()):
        try:
            rank = trace_rank(read_trace(path))
        except ValueError:
            continue
        rank = rank if rank is not None else rank_from_name(path.name)
        (ranks[rank] if rank is not None else unranked).append(path)
    if len(unranked) == 1 and not ranks:
        return {0: unranked}
    if unranked:
        raise ValueError(f"Which rank wrote {', '.join(map(str, unranked))}? Their trace has no distributedInfo "
                         "and their name no `rank<N>`. HINT: rename them rank<N>.json.")
    if not ranks:
        raise ValueError(f"No torch.profiler trace (*.json, *.json.gz) under {folder}. {_HINT}")
    return dict(sorted(ranks.items()))


def dims_from_trace(trace: dict) -> dict[str, int]:
    """pp, dp_replicate, dp_shard, cp, tp, ep from the sizes of the ``mesh_<dim>`` process groups in
    ``distributedInfo.pg_config`` (1 when absent). A mesh dim spanning the whole world reuses the default group
    (no ``mesh_<dim>``): when exactly one of the five is missing it takes what the world size leaves.
    ``dp_shard`` under ep is ``mesh_dp_shard_mod_ep`` x ``mesh_dp_shard_in_ep``."""
    info = trace.get("distributedInfo") or {}
    configs = info.get("pg_config") or []
    sizes: dict[str, int] = {}
    for config in configs.values() if isinstance(configs, dict) else configs:
        description = str(config.get("pg_desc", ""))
        if description.startswith("mesh_"):
            sizes.setdefault(description[len("mesh_"):], int(config.get("pg_size", 1)))
    if "dp_shard" not in sizes and {"dp_shard_mod_ep", "dp_shard_in_ep"} <= sizes.keys():
        sizes["dp_shard"] = sizes["dp_shard_mod_ep"] * sizes["dp_shard_in_ep"]
    dims = {dim: sizes.get(dim, 1) for dim in DIMS}
    missing = [dim for dim in MESH_DIMS if dim not in sizes]
    world = int(info.get("world_size") or 1)
    known = prod(dims[dim] for dim in MESH_DIMS)
    if len(missing) == 1 and world % known == 0:
        dims[missing[0]] = world // known
    return dims


def trace_steps(trace: dict, dims: dict[str, int] | None = None) -> list[TraceStep]:
    """Every step on the trace's main thread, in order. ``dims`` (default `dims_from_trace`) name the role of a
    collective no label names (`trace_timeline.Labeller`: tp, ep, pp, cp, dp_replicate only where that dim is
    > 1)."""
    threads = thread_events(trace)
    main = main_thread(threads)
    if main is None:
        return []
    events = sorted_events(threads[main])
    dims = {**dict.fromkeys(DIMS, 1), **(dims if dims is not None else dims_from_trace(trace))}
    steps = [(ts, end) for ts, _, _, end, name, _, _ in events if name.startswith(STEP) and name[len(STEP):].isdigit()]
    span = (events[0][0], max(event[3] for event in events))
    fallback = not any(name.startswith(PHASE) or name == PIPELINE for _, _, _, _, name, _, _ in events)
    if fallback:
        events = fallback_phases(events, steps or [span])
    labeller = Labeller(dims, fallback)
    segments = timeline(events, span, State(OUTSIDE if steps else None, None, False, None, None, False, not steps),
                        labeller)
    if device_events(trace):
        split = device_split(trace, threads, main, segments, labeller)
    else:
        split = defaultdict(lambda: defaultdict(float))
        for start, end, state in segments:
            split[state.step][cpu_part(state)] += end - start
    return [_step(step, split[step]) for step in _order(segments) if step in split]


def _order(segments: list[tuple[float, float, State]]) -> list[int | None]:
    """The steps, by their first instant."""
    return list(dict.fromkeys(state.step for _, _, state in segments if state.step != OUTSIDE))


def _step(step: int | None, micros: dict[tuple[str, str], float]) -> TraceStep:
    split: dict[str, dict[str, float]] = {}
    for (region, part), us in sorted(micros.items()):
        split.setdefault(region, {})[part] = us / 1e6
    return TraceStep(step=step, step_s=sum(micros.values()) / 1e6, split=split)


def rank_times(steps: Sequence[TraceStep], rank: int) -> RankTimes:
    """The mean over ``steps`` as the bottleneck contract's `RankTimes`: ``data_wait`` the loader,
    ``forward`` / ``backward`` / ``optimizer`` their regions' compute, ``pipeline_idle``, ``host`` (the
    data_wait region's other time), communication per role. ``waiting`` stays 0: only a comparison across
    ranks tells a collective's wait from its transfer (`diagnostics.analysis.bottleneck.attribute_waiting`). The
    residual is 0 up to rounding: a trace's step is tiled by its parts."""
    if not steps:
        raise ValueError(f"rank_times got no steps for rank {rank}. HINT: the trace's main thread had no event.")
    phases = dict.fromkeys(PHASES, 0.0)
    comm: dict[str, float] = defaultdict(float)
    for step in steps:
        for region, parts in step.split.items():
            for part, seconds in parts.items():
                if part.startswith(COMM):
                    comm[part[len(COMM):]] += seconds / len(steps)
                else:
                    phases[phase_of(region, part)] += seconds / len(steps)
    step_s = sum(step.step_s for step in steps) / len(steps)
    return RankTimes(rank=rank, steps=len(steps), step_s=step_s, phases=phases, comm=dict(comm),
                     residual_s=step_s - sum(phases.values()) - sum(comm.values()))
