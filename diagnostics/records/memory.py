"""What the memory probe records when a rank runs out of memory: the parsed message, the breakdown measured next
to the analytic expectation, and the ranked fixes (``<log_dir>/diagnostics/memory-rank<R>.json``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    dims: dict[str, int] = field(default_factory=dict)
    """The layout that ran out (``{"dp_shard": 4, "tp": 2}``)."""
    options: dict[str, Any] = field(default_factory=dict)
    """The ``NDParallel`` options it ran with (activation checkpointing, mixed precision, ...)."""
    notes: tuple[str, ...] = ()
