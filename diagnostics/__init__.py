"""Diagnostics for N-D parallel runs: thin Lightning callbacks (``callbacks/``) over probes that record
(``collect/``), pure analyses of recorded data (``analysis/``) and the cards they become (``report/``); the records
themselves (``records.py``) are what the offline CLI (``python -m diagnostics``) reads back."""

from __future__ import annotations

from typing import Any

__all__ = ["CollectiveMonitor", "LayoutCard", "MemoryMonitor"]


def __getattr__(name: str) -> Any:
    """The callbacks import Lightning: loaded when asked for, so the offline CLI starts at once."""
    if name == "CollectiveMonitor":
        from diagnostics.callbacks.collective_monitor import CollectiveMonitor

        return CollectiveMonitor
    if name == "LayoutCard":
        from diagnostics.callbacks.layout import LayoutCard

        return LayoutCard
    if name == "MemoryMonitor":
        from diagnostics.callbacks.memory_monitor import MemoryMonitor

        return MemoryMonitor
    raise AttributeError(f"module 'diagnostics' has no attribute {name!r}")
