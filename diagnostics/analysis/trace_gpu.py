"""The parts of a step on a GPU trace (NCCL): what the device did at each instant, in the region of the CPU op
that launched it.

Kineto's device events (``cat`` ``kernel``, ``gpu_memcpy``, ``gpu_memset``, on the device's pid, one tid per
stream) are linked to their launch (``cuda_runtime`` / ``cuda_driver``: ``cudaLaunchKernel``...) by the
``correlation`` arg. At each instant of a step:

- a compute kernel (any kernel not named ``nccl*``, copies and memsets included) runs: ``compute`` of the region
  of the CPU op that launched it (where two overlap, the earlier started);
- else an NCCL kernel runs: it is exposed, ``comm:<role>`` (``pipeline_idle`` for pp's send / recv inside
  ``nd::pipeline``), the role from the launching thread at the launch: our ``nd::comm::<role>`` label, else the
  process group's description (``mesh_tp`` -> ``tp``; from the kernel's own args, else the enclosing
  ``record_param_comms``), else the enclosing FSDP region or the op's kind, ``world`` for the default group;
- else the device is idle: the main thread's region decides, ``loader`` inside the loader's fetch,
  ``pipeline_idle`` inside ``nd::pipeline``, ``host`` elsewhere (the GPU waits for the CPU). With NCCL the CPU
  only enqueues a collective, so CPU time inside one is not communication here.

Tested on synthetic traces in Kineto's format only: no GPU trace is recorded in this repository.
"""

from __future__ import annotations

from collections import defaultdict

from diagnostics.analysis.trace_timeline import (
    GROUP_ARG,
    Labeller,
    State,
    group_role,
    sorted_events,
    state_at,
    timeline,
)

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})
Piece = tuple  # (start, end, key): disjoint, sorted by start
_THREAD = State(None, None, False, None, None, False, False)
"""Where another thread's timeline starts: only the roles of its events matter."""


def device_events(trace: dict) -> list[dict]:
    return [e for e in trace.get("traceEvents", ()) if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS
            and e.get("dur", 0) > 0]


def idle_part(state: State) -> tuple[str, str]:
    """(region, part) of an instant the device is idle."""
    region = state.region or "data_wait"
    if state.loader:
        return region, "loader"
    return region, "pipeline_idle" if region == "pipeline" else "host"


def union(intervals: list[tuple[float, float, tuple]]) -> list[Piece]:
    """Disjoint pieces covering ``intervals``; where two overlap, the earlier started keeps its key."""
    pieces: list[Piece] = []
    covered = float("-inf")
    for start, end, key in sorted(intervals, key=lambda interval: interval[0]):
        if end > covered:
            pieces.append((max(start, covered), end, key))
            covered = end
    return pieces


def overlay(base: list[Piece], top: list[Piece]) -> list[Piece]:
    """``base`` (keys ``(step, key)``, tiling the steps) with ``top``'s pieces painted over it, each taking the
    step of the base piece it falls in."""
    out: list[Piece] = []
    first = 0
    for start, end, (step, key) in base:
        now = start
        while first < len(top) and top[first][1] <= now:
            first += 1
        index = first
        while index < len(top) and top[index][0] < end:
            top_start, top_end, top_key = top[index]
            if top_start > now:
                out.append((now, top_start, (step, key)))
            now = max(now, top_start)
            out.append((now, min(top_end, end), (step, top_key)))
            now = min(top_end, end)
            if top_end > end:
                break
            index += 1
        first = index
        if now < end:
            out.append((now, end, (step, key)))
    return out


class _Launches:
    """Where each kernel was launched: the launching thread's `State` then, and the main thread's region."""

    def __init__(self, trace: dict, threads: dict[tuple, list[dict]], main: tuple,
                 main_segments: list[tuple[float, float, State]], labeller: Labeller) -> None:
        self.by_correlation: dict = {}
        for event in trace.get("traceEvents", ()):
            if event.get("ph") == "X" and event.get("cat") in LAUNCH_CATS:
                correlation = (event.get("args") or {}).get("correlation")
                if correlation is not None:
                    self.by_correlation[correlation] = ((event.get("pid"), event.get("tid")), float(event["ts"]))
        self.timelines = {main: (main_segments, [s[0] for s in main_segments])}
        self.threads, self.main, self.labeller = threads, main, labeller

    def thread_state(self, thread: tuple, ts: float) -> State | None:
        if thread not in self.timelines:
            events = sorted_events(self.threads.get(thread, []))
            span = (min((e[0] for e in events), default=ts), max((e[3] for e in events), default=ts))
            segments = timeline(events, span, _THREAD, self.labeller)
            self.timelines[thread] = (segments, [s[0] for s in segments])
        return state_at(*self.timelines[thread], ts)

    def launch(self, kernel: dict) -> tuple[State | None, State | None]:
        """(the launching thread's state, the main thread's state) at the kernel's launch (at its start on the
        main thread when no launch is recorded)."""
        found = self.by_correlation.get((kernel.get("args") or {}).get("correlation"))
        thread, ts = found if found is not None else (self.main, float(kernel["ts"]))
        return self.thread_state(thread, ts), self.thread_state(self.main, ts)


def nccl_role(kernel: dict, launcher: State | None) -> str:
    """Our label's role; else the kernel's own process group; else the launch context's; else ``other``."""
    if launcher is not None and launcher.ctx == "nd":
        return launcher.role
    description = (kernel.get("args") or {}).get(GROUP_ARG)
    mesh = group_role(description)
    if mesh is not None:
        return mesh
    if launcher is not None and launcher.role is not None:
        return launcher.role
    return "world" if description == "default_pg" else "other"


def device_split(trace: dict, threads: dict[tuple, list[dict]], main: tuple,
                 segments: list[tuple[float, float, State]], labeller: Labeller
                 ) -> dict[int | None, dict[tuple[str, str], float]]:
    """Step -> (region, part) -> microseconds: the steps' main-thread ``segments`` repainted with what the device
    did (see the module's docstring)."""
    launches = _Launches(trace, threads, main, segments, labeller)
    compute, nccl = [], []
    for kernel in device_events(trace):
        launcher, on_main = launches.launch(kernel)
        region = (on_main.region if on_main is not None else None) or "data_wait"
        start = float(kernel["ts"])
        interval = (start, start + float(kernel["dur"]))
        name = str(kernel.get("name", ""))
        if name.startswith("nccl"):
            role = nccl_role(kernel, launcher)
            p2p = (launcher is not None and launcher.p2p) or "SendRecv" in name
            part = "pipeline_idle" if region == "pipeline" and role == "pp" and p2p else f"comm:{role}"
            nccl.append((*interval, (region, part)))
        else:
            compute.append((*interval, (region, "compute")))
    base = [(start, end, (state.step, idle_part(state))) for start, end, state in segments]
    painted = overlay(overlay(base, union(nccl)), union(compute))
    split: dict[int | None, dict[tuple[str, str], float]] = defaultdict(lambda: defaultdict(float))
    for start, end, (step, key) in painted:
        split[step][key] += end - start
    return split
