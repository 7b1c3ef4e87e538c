"""One thread of a `torch.profiler` trace as a timeline: the instants of its span cut into segments, each with
the step, the region (the phase) and the communication (which mesh role) it belongs to.

A thread's events nest (a record_function holds the ops it ran, an op its sub-ops). One sorted pass with a stack
gives every instant its innermost event, and each event's `State` is derived from its parent's once, so nested
events never count twice. A child that outlasts its parent is cut at the parent's end.

The labels are those of `lightning_nd.runtime.profiling` (the contract; not imported, it imports torch):
``nd::phase::<name>`` (innermost wins: under automatic optimization the optimizer label holds forward and
backward), ``nd::pipeline`` and ``nd::comm::<role>::<op>``, and torch's own: ``ProfilerStep#N``,
``enumerate(DataLoader)#...``, FSDP2's ``FSDP::*``. Gloo's ``gloo:*`` events are left out: they span a
collective's work from issue to completion (on the main thread for send / recv), not the time the thread blocks.

Pure: stdlib only.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from typing import NamedTuple

PHASE = "nd::phase::"
PIPELINE = "nd::pipeline"
COMM = "nd::comm::"
STEP = "ProfilerStep#"
LOADER = "enumerate(DataLoader)#"
FSDP = "FSDP::"
COMM_OPS = ("c10d::", "_c10d_functional::", "record_param_comms", "nccl:")
OPTIMIZER_STEP = "Optimizer.step#"
OPTIMIZER_LABELS = (OPTIMIZER_STEP, "Optimizer.zero_grad#")
CPU_CATS = frozenset({"cpu_op", "user_annotation"})
_BACKWARD_OP = re.compile(r"^autograd::engine::evaluate_function|Backward\d*$")
GROUP_ARG = "Process Group Description"
OUTSIDE = -1
"""The step of an instant outside every ``ProfilerStep#N``."""

Event = tuple
"""``(ts, -end, order, end, name, cat, group)`` in microseconds, sorted as tuples (outer events first)."""


class State(NamedTuple):
    """What an instant inside an event belongs to."""

    step: int | None
    """``N`` of its ``ProfilerStep#N``; None in a trace without them; `OUTSIDE` between steps."""
    region: str | None
    """forward, backward, optimizer or pipeline; None: in no phase (``data_wait``)."""
    loader: bool
    role: str | None
    """The mesh role of the innermost communication it is in; None: in none."""
    ctx: str | None
    """What set the role: ``nd`` (our label), ``fsdp`` (an FSDP region), ``op`` (a collective op)."""
    p2p: bool
    """Inside a point-to-point op (send / recv)."""
    top: bool
    """The step itself (its direct children are top-level)."""


def group_role(description: str | None) -> str | None:
    """``mesh_tp`` -> ``tp``: the role of a process group named by `lightning_nd`'s mesh; None otherwise."""
    return description[len("mesh_"):] if description and description.startswith("mesh_") else None


def is_comm_op(name: str) -> bool:
    """A collective op: ``c10d::``, ``_c10d_functional::`` (and their autograd nodes), ``record_param_comms``,
    ``nccl:``."""
    return name.startswith(COMM_OPS) or "c10d_functional" in name


def _flat(name: str) -> str:
    return name.replace("_", "").lower()


class Labeller:
    """Derives a child's `State` from its parent's and the event's name, memoised (a trace repeats few names)."""

    def __init__(self, dims: dict[str, int], fallback: bool) -> None:
        """``fallback``: the trace has no ``nd::`` phase label (a plain user's), so torch's labels stand in."""
        self.dims, self.fallback = dims, fallback
        self._memo: dict[tuple, State] = {}
        self._states: dict[State, State] = {}

    def child(self, parent: State, name: str, cat: str, group: str | None) -> State:
        """One object per distinct state, so `timeline` merges neighbours by identity."""
        key = (parent, name, cat, group)
        state = self._memo.get(key)
        if state is None:
            derived = self._derive(parent, name, cat, group)
            state = self._memo[key] = self._states.setdefault(derived, derived)
        return state

    def _derive(self, parent: State, name: str, cat: str, group: str | None) -> State:
        if name.startswith(STEP) and name[len(STEP):].isdigit():
            return State(int(name[len(STEP):]), None, False, None, None, False, True)
        region = parent.region
        if name.startswith(PHASE):
            phase = name[len(PHASE):]
            region = "backward" if phase.startswith("backward") else phase
        elif name == PIPELINE:
            region = "pipeline"
        elif self.fallback and name.startswith(OPTIMIZER_LABELS):
            region = "optimizer"
        role, ctx = self._role(parent, name, group)
        loader = parent.loader or name.startswith(LOADER)
        if self.fallback and parent.top and region is None and cat == "cpu_op" and role is None and not loader:
            region = "forward"  # a plain trace's top-level op
        p2p = parent.p2p or (is_comm_op(name) and ("send" in name or "recv" in name))
        return State(parent.step, region, loader, role, ctx, p2p, False)

    def _role(self, parent: State, name: str, group: str | None) -> tuple[str | None, str | None]:
        """Innermost wins: our label's role; an FSDP region's; a collective's from its process group, its
        enclosing label or op, else its kind."""
        if name.startswith(COMM):
            return name[len(COMM):].split("::", 1)[0] or "other", "nd"
        if name.startswith(FSDP):
            return "fsdp", "fsdp"
        if not is_comm_op(name) or parent.ctx == "nd":
            return parent.role, parent.ctx
        mesh = group_role(group)
        if mesh is not None:
            return mesh, "op"
        if parent.ctx == "fsdp":
            replica = "allreduce" in _flat(name) and self.dims.get("dp_replicate", 1) > 1
            return ("dp_replicate" if replica else "fsdp"), "op"  # HSDP's all-reduce over the replicas
        if parent.ctx == "op" and parent.role != "other":
            return parent.role, "op"
        return ("world" if group == "default_pg" else self._kind(name)), "op"

    def _kind(self, name: str) -> str:
        """An unlabelled collective's role by its kind: all-to-all is ep's, send / recv pp's (else cp's), a
        functional collective (DTensor's) tp's; anything else (Lightning's own) ``other``."""
        flat, dims = _flat(name), self.dims
        if "alltoall" in flat and dims.get("ep", 1) > 1:
            return "ep"
        if "send" in flat or "recv" in flat:
            return "pp" if dims.get("pp", 1) > 1 else "cp" if dims.get("cp", 1) > 1 else "other"
        if "c10d_functional" in name and dims.get("tp", 1) > 1:
            return "tp"
        return "other"


def cpu_part(state: State) -> tuple[str, str]:
    """(region, part) of an instant of a CPU trace: communication blocks the thread there (gloo), so its time
    is exposed; the rest of a phase is compute (Python between ops included, as the live phase timer counts it)."""
    region = state.region or "data_wait"
    if state.role is not None:
        pipeline_wait = region == "pipeline" and state.role == "pp" and state.p2p
        return region, "pipeline_idle" if pipeline_wait else f"comm:{state.role}"
    if state.loader:
        return region, "loader"
    return region, {"data_wait": "host", "pipeline": "pipeline_idle"}.get(region, "compute")


def thread_events(trace: dict) -> dict[tuple, list[dict]]:
    """(pid, tid) -> the thread's complete CPU events (ops and record_functions), gloo's work spans left out."""
    threads: dict[tuple, list[dict]] = {}
    for event in trace.get("traceEvents", ()):
        if (event.get("cat") in CPU_CATS and event.get("ph") == "X" and event.get("dur", 0) > 0
                and not str(event.get("name", "")).startswith("gloo:")):
            threads.setdefault((event.get("pid"), event.get("tid")), []).append(event)
    return threads


def main_thread(threads: dict[tuple, list[dict]]) -> tuple | None:
    """The thread with ``ProfilerStep#`` or ``nd::phase::`` labels, else the one with the most time in events."""
    labelled = [key for key, events in threads.items()
                if any(str(e.get("name", "")).startswith((STEP, PHASE)) for e in events)]
    candidates = labelled or list(threads)
    return max(candidates, key=lambda key: sum(e["dur"] for e in threads[key]), default=None)


def sorted_events(raw: list[dict]) -> list[Event]:
    events = []
    for order, e in enumerate(raw):
        ts, name = float(e["ts"]), str(e.get("name", ""))
        group = (e.get("args") or {}).get(GROUP_ARG) if name == "record_param_comms" else None
        events.append((ts, -(ts + float(e["dur"])), order, ts + float(e["dur"]), name, e.get("cat"), group))
    events.sort()
    return events


def fallback_phases(events: list[Event], steps: list[tuple[float, float]]) -> list[Event]:
    """Phase labels for a plain trace, from torch's: in each step, ``backward`` from its first backward op
    (``autograd::engine::evaluate_function: ...``, ``*Backward0``) to its last one's end; ``forward`` from the
    start of the ``Optimizer.step#`` holding that backward to it (Lightning runs the training step and backward
    inside the optimizer's closure). ``Optimizer.step#`` / ``zero_grad#`` elsewhere are the optimizer, other
    top-level ops forward (`Labeller`). A heuristic: our labels, when present, are used instead."""
    starts = [start for start, _ in steps]
    backward: dict[int, list[float]] = {}
    optimizer: list[tuple[float, float]] = []
    for ts, _, _, end, name, _, _ in events:
        if name.startswith(OPTIMIZER_STEP):
            optimizer.append((ts, end))
        elif _BACKWARD_OP.search(name):
            index = bisect_right(starts, ts) - 1
            if index >= 0 and ts < steps[index][1]:
                span = backward.setdefault(index, [ts, end])
                span[1] = max(span[1], end)
    synthetic = []
    for first, last in backward.values():
        synthetic.append((first, -last, -len(synthetic) - 1, last, PHASE + "backward", "user_annotation", None))
        holder = next(((ts, end) for ts, end in optimizer if ts < first < end), None)
        if holder is not None:
            synthetic.append((holder[0], -first, -len(synthetic) - 1, first, PHASE + "forward", "user_annotation",
                              None))
    return sorted(events + synthetic)


def timeline(events: list[Event], span: tuple[float, float], root: State, labeller: Labeller
             ) -> list[tuple[float, float, State]]:
    """The segments ``(start, end, state)`` tiling ``span``: each instant under its innermost event, neighbours
    in the same state merged (a segment closes only where the state changes)."""
    child = labeller.child
    stack: list[tuple[float, State]] = [(span[1], root)]
    segments: list[tuple[float, float, State]] = []
    start, current = span[0], root  # the open segment

    def switch(at: float, state: State) -> None:
        nonlocal start, current
        if at > start:
            segments.append((start, at, current))
        start, current = at, state

    for ts, _, _, end, name, cat, group in events:
        while len(stack) > 1 and stack[-1][0] <= ts:
            top_end = stack.pop()[0]
            if stack[-1][1] is not current:  # the parent's state resumes
                switch(top_end, stack[-1][1])
        parent_end, parent = stack[-1]
        end = end if end < parent_end else parent_end
        if end > ts:
            state = child(parent, name, cat, group)
            stack.append((end, state))
            if state is not current:
                switch(ts, state)
    while len(stack) > 1:
        top_end = stack.pop()[0]
        if stack[-1][1] is not current:
            switch(top_end, stack[-1][1])
    switch(span[1], root)  # closes the last segment
    return segments


def state_at(segments: list[tuple[float, float, State]], starts: list[float], ts: float) -> State | None:
    """The state of the segment holding ``ts`` (``starts``: the segments' starts), None outside them."""
    index = bisect_right(starts, ts) - 1
    return segments[index][2] if index >= 0 and ts < segments[index][1] else None
