"""Diagnostics for N-D parallel runs: thin Lightning callbacks (``callbacks/``) over probes that record
(``collect/``), pure analyses of recorded data (``analysis/``) and the cards they become (``report/``); the records
themselves (``records/``, one JSON codec for all) are what the offline CLI (``python -m diagnostics``) reads
back. ``all_monitors()`` turns everything on."""

from __future__ import annotations

from typing import Any

__all__ = ["BottleneckMonitor", "CollectiveMonitor", "CompareSweep", "LayoutCard", "MemoryMonitor",
           "RoutingMonitor", "RunSummary", "TroubleshootingView", "all_monitors"]
_CALLBACKS = {"BottleneckMonitor": "bottleneck_monitor", "CollectiveMonitor": "collective_monitor",
              "LayoutCard": "layout", "MemoryMonitor": "memory_monitor", "RoutingMonitor": "routing_monitor",
              "RunSummary": "run_summary", "CompareSweep": "sweep_comparison",
              "TroubleshootingView": "troubleshooting_view"}


def __getattr__(name: str) -> Any:
    """The callbacks import Lightning: loaded when asked for, so the offline CLI starts at once."""
    if name in _CALLBACKS:
        import importlib

        return getattr(importlib.import_module(f"diagnostics.callbacks.{_CALLBACKS[name]}"), name)
    raise AttributeError(f"module 'diagnostics' has no attribute {name!r}")


def all_monitors(log_dir: str | None = None, collectives: dict[str, Any] | bool = True,
                 memory: dict[str, Any] | bool = True, bottleneck: dict[str, Any] | bool = True,
                 routing: dict[str, Any] | bool = True, summary: dict[str, Any] | bool = True) -> list[Any]:
    """Every monitor, the `LayoutCard` and the `TroubleshootingView` (first: the monitors register their charts in
    it), writing into ``log_dir`` (default: the Trainer's ``default_root_dir``). Each monitor's argument: True (its
    defaults), a dict of its keyword arguments, or False (left out). The `RoutingMonitor` does nothing on a model
    without MoE layers; the `RunSummary` (last: it reads what the others wrote) leaves the record a sweep's
    comparison reads."""
    # The BottleneckMonitor first: its profiled step ends before the other monitors' step-end gathers run.
    chosen = {"BottleneckMonitor": bottleneck, "CollectiveMonitor": collectives, "MemoryMonitor": memory,
              "RoutingMonitor": routing, "RunSummary": summary}
    for name, value in chosen.items():
        if not isinstance(value, (bool, dict)):
            raise TypeError(f"`all_monitors({name}={value!r})`: pass True, False or a dict of `{name}` keyword"
                            " arguments.")
    monitors = [__getattr__("TroubleshootingView")(), __getattr__("LayoutCard")()]
    for name, value in chosen.items():
        if value is not False:
            monitors.append(__getattr__(name)(log_dir=log_dir, **(value if isinstance(value, dict) else {})))
    return monitors
