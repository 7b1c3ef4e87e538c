"""``Trainer(strategy="nd")`` after ``import lightning_nd``, without importing Lightning at that import.

Lightning keeps strategies by name in ``lightning.pytorch.strategies.StrategyRegistry``, which it fills only with
its own classes, so a name is added from outside. ``import lightning_nd`` must stay free of Lightning (the dry run
and the pure layers never need it), so the entry is added when Lightning's strategies module is imported: at once
if it already is, otherwise by a finder on ``sys.meta_path`` that wraps that module's loader and adds the entry
right after the module runs, then removes itself. The entry is a factory that imports `NDParallel` only when a
Trainer asks for it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

STRATEGIES = "lightning.pytorch.strategies"
NAME = "nd"
DESCRIPTION = "N-D parallel: FSDP2/HSDP x TP x PP x CP x EP (lightning-nd)"


def nd_parallel(**arguments: Any) -> Any:
    """What ``Trainer(strategy="nd")`` builds: `NDParallel` with every default (dp_shard fills the world)."""
    from lightning_nd.strategy.nd_parallel import NDParallel

    return NDParallel(**arguments)


def register(strategies: ModuleType) -> None:
    registry = strategies.StrategyRegistry
    if NAME not in registry:
        registry.register(NAME, nd_parallel, description=DESCRIPTION)


class _Loader(importlib.abc.Loader):
    """Lightning's own loader of its strategies module, then the registration."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        register(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds Lightning's strategies module with the other finders and hands it our loader."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != STRATEGIES:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def register_when_imported() -> None:
    """Add ``"nd"`` now if Lightning's strategies are loaded, else once they are (in either import order)."""
    if STRATEGIES in sys.modules:
        register(sys.modules[STRATEGIES])
    elif not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
