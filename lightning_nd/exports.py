"""A package's face: its entry points by name, each imported from its module when first used.

A technique package's planning side is imported by the layout before any process starts, so its ``__init__`` may
not import its application side (which loads torch's pipelining or DTensor styles) just to name it:

    __all__, __getattr__, __dir__ = lazy_exports(__name__, {"apply_tp": "lightning_nd.tensor_parallel.apply.model"})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, a module ``__getattr__`` and ``__dir__`` for ``package``: ``exports`` maps a name to its module
    (``"module:attribute"`` where the module calls it otherwise)."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = exports[name].partition(":")
        value = getattr(importlib.import_module(module), attribute or name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return sorted(exports), __getattr__, __dir__
