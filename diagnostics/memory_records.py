"""What the memory probe records when a rank runs out of memory: the parsed message, the breakdown measured next
to the analytic expectation, and the ranked fixes (``<log_dir>/diagnostics/memory-rank<R>.json``).

Kept apart from ``records.py`` (the hang records) so each stays one concept; written with ``records.to_json``.
Nothing here imports torch or Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

MEMORY_FILE = "memory-rank{rank}.json"
KINDS = ("params", "grads", "optimizer", "activations", "temporaries", "non_pytorch", "total")


@dataclass(frozen=True)
class OomMessage:
    """An out-of-memory message as torch printed it; a field it did not print is None."""

    device: str = ""
    """``cuda:0`` (also for ROCm's ``HIP out of memory``), ``cpu``; empty when the text is no known OOM message."""
    requested_bytes: int | None = None
    capacity_bytes: int | None = None
    """The device's total memory (``cudaMemGetInfo``), not what this process may use: see ``allowed_bytes``."""
    free_bytes: int | None = None
    process_in_use_bytes: int | None = None
    """``this process has X memory in use``: everything on the device, PyTorch's or not (torch >= 2.1, via NVML)."""
    allocated_bytes: int | None = None
    """Held by live tensors (``allocated by PyTorch``, before torch 2.1 ``already allocated``)."""
    reserved_unallocated_bytes: int | None = None
    """Cached by the allocator, in no tensor (``reserved by PyTorch but unallocated``): fragmentation."""
    allowed_bytes: int | None = None
    """The cap ``torch.cuda.set_per_process_memory_fraction`` set (``X allowed;``), when one is set."""
    other_processes: tuple[tuple[int, int], ...] = ()
    """``(pid, bytes)`` for each ``Process N has X memory in use``. In a container NVML's pids are the host's, so
    the process itself can show up here instead of as ``this process``."""
    text: str = ""
    """The message's line, at most 500 characters."""


@dataclass(frozen=True)
class MemoryFigure:
    """One row of the breakdown: what the rank held of one kind, measured and expected."""

    kind: str
    """One of ``KINDS``."""
    measured_bytes: int | None
    """None: not measurable here (activations and temporaries on CPU, where no allocator keeps statistics)."""
    expected_bytes: int | None
    """The cost model's number for this rank; None when it has none (non-PyTorch memory)."""
    source: str
    """How it was measured: ``local shards``, ``CUDA allocator``, ``process RSS``, ``unknown on CPU``."""


@dataclass(frozen=True)
class Advice:
    """One fix: the overrides that make it and the peak the cost model predicts with them."""

    action: str
    """As a person types it: ``NDParallel(activation_checkpointing='full')``."""
    change: dict[str, Any]
    """The ``NDParallel``/``Trainer`` overrides: ``{"activation_checkpointing": "full"}``,
    ``{"tp": 2, "dp_shard": 2}``."""
    saving_bytes: int
    peak_after_bytes: int
    detail: str
    """Why it saves what it saves, and what it costs (recompute, more communication)."""


@dataclass(frozen=True)
class MemoryReport:
    """Everything one rank wrote when it (or its peer ``culprit``) ran out of memory."""

    rank: int
    step: int | None
    culprit: int | None
    """The rank that ran out; None when unknown (this rank's peers failed first)."""
    device: str
    capacity_bytes: int | None
    oom: OomMessage | None
    """None when the failure left no message to parse (the process was killed, the text was lost)."""
    figures: tuple[MemoryFigure, ...]
    """In ``KINDS`` order, the total last."""
    advice: tuple[Advice, ...]
    """Largest saving first."""
    dims: dict[str, int]
    """The layout that ran out (``{"dp_shard": 4, "tp": 2}``)."""
    options: dict[str, Any]
    """The ``NDParallel`` options it ran with (activation checkpointing, mixed precision, ...)."""
    notes: tuple[str, ...] = ()


def _oom_from_dict(values: dict[str, Any]) -> OomMessage:
    known = {f.name for f in fields(OomMessage)}
    rest = {k: v for k, v in values.items() if k in known and k != "other_processes"}
    others = tuple((int(pid), int(count)) for pid, count in values.get("other_processes", ()))
    return OomMessage(other_processes=others, **rest)


def memory_report_from_dict(values: dict[str, Any]) -> MemoryReport:
    """The inverse of ``records.to_dict`` on a ``MemoryReport``."""
    oom = _oom_from_dict(values["oom"]) if values.get("oom") is not None else None
    return MemoryReport(
        rank=int(values["rank"]), step=values.get("step"), culprit=values.get("culprit"), device=values["device"],
        capacity_bytes=values.get("capacity_bytes"), oom=oom,
        figures=tuple(MemoryFigure(**figure) for figure in values["figures"]),
        advice=tuple(Advice(**advice) for advice in values["advice"]),
        dims=dict(values.get("dims", {})), options=dict(values.get("options", {})),
        notes=tuple(values.get("notes", ())))


__all__ = ["KINDS", "MEMORY_FILE", "Advice", "MemoryFigure", "MemoryReport", "OomMessage", "memory_report_from_dict"]
