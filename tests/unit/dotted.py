"""A dotted path as the docs write one (``lightning_nd.nn.moe.MoE``): its longest importable module, then attributes."""

from __future__ import annotations

import importlib


def resolve(dotted: str) -> object | None:
    """What ``dotted`` names, or None when no module prefix imports or an attribute is missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute, None)
        return found
    return None
