"""A finished `torch.profiler.profile`'s CPU events as the trace analysis reads a chrome trace, without the file.

`diagnostics.analysis.trace.trace_steps` reads Kineto's chrome-trace JSON. Writing that file and reading it back
costs a live monitor about as much as the analysis itself (a profiled step of a small model has ~10,000 events), so
`in_memory_trace` builds the same events straight from the profiler's results: complete (``"ph": "X"``) events
with their name, category (``cpu_op``, ``user_annotation``...), thread, start and duration in microseconds, and a
``record_param_comms``'s process-group description (the analysis keeps the categories it reads). Only CPU traces: one that holds device events (CUDA kernels,
whose analysis reads their correlation ids) gives None, and the caller exports and reads the file instead.
"""

from __future__ import annotations

import json
from typing import Any

from torch.autograd import DeviceType

GROUP_ARG = "Process Group Description"
"""Kineto's name, in a chrome trace's ``args``, for the group a ``record_param_comms`` ran on."""


def in_memory_trace(profiler: Any) -> dict | None:
    """``{"traceEvents": [...]}`` of a stopped ``torch.profiler.profile``, or None when it recorded a device."""
    results = getattr(getattr(profiler, "profiler", None), "kineto_results", None)
    if results is None:
        return None
    events = []
    for event in results.events():
        if event.device_type() != DeviceType.CPU:
            return None
        if event.is_hidden_event():
            continue
        name = event.name()
        args = {}
        if name == "record_param_comms":
            description = _metadata(event).get(GROUP_ARG)
            if description is not None:
                args[GROUP_ARG] = description
        events.append({"ph": "X", "cat": event.activity_type(), "name": name, "pid": 0, "tid": event.start_thread_id(),
                       "ts": event.start_ns() / 1e3, "dur": event.duration_ns() / 1e3, "args": args})
    return {"traceEvents": events}


def _metadata(event: Any) -> dict:
    """The event's Kineto metadata (``"key": value`` pairs, without the braces), {} when it does not parse."""
    text = event.metadata_json()
    try:
        value = json.loads("{" + text + "}") if text and not text.lstrip().startswith("{") else json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
