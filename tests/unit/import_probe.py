"""Run in a fresh interpreter by `test_import_contracts.py`, with the packages to check on ``PYTHONPATH``: import
every module of each layer while a finder refuses, and records, the modules that layer must not load; print what
was refused (and by which of our modules), what failed to import, and what is loaded all the same, as JSON.

    python tests/unit/import_probe.py   # prints {"attempts": [...], "failures": [...], "leaked": [...]}
"""

from __future__ import annotations

import importlib
import importlib.abc
import json
import pkgutil
import sys
import traceback

LIGHTNING = ("lightning", "pytorch_lightning")
PHASES = (
    # (modules, what they must not load), in this order: an earlier phase's modules stay loaded. ``x.*``: the
    # package ``x`` and every module in it.
    (("diagnostics.analysis.*", "diagnostics.records.*"),
     ("torch", "lightning_nd", *LIGHTNING, "transformers")),
    (("lightning_nd", "lightning_nd.layout.*", "lightning_nd.cost.*", "lightning_nd.planner.*", "lightning_nd.plan.*",
      "lightning_nd.mesh.*", "lightning_nd.model.*", "lightning_nd.tensor_parallel",
      "lightning_nd.tensor_parallel.styles", "lightning_nd.tensor_parallel.infer.*", "lightning_nd.pipeline_parallel",
      "lightning_nd.pipeline_parallel.split", "lightning_nd.pipeline_parallel.schedules",
      "lightning_nd.context_parallel", "lightning_nd.context_parallel.positions",
      "lightning_nd.context_parallel.sharding"),
     (*LIGHTNING, "transformers", "torch.distributed.pipelining")),
    (("lightning_nd.nn.*", "lightning_nd.parallel.*", "lightning_nd.runtime.*", "lightning_nd.checkpoint.*",
      "lightning_nd.tensor_parallel.*", "lightning_nd.pipeline_parallel.*", "lightning_nd.context_parallel.*",
      "lightning_nd.expert_parallel.*"),
     (*LIGHTNING, "transformers")),
)
OURS = ("lightning_nd", "diagnostics")


def _forbidden(name: str, forbidden: tuple[str, ...]) -> bool:
    return any(name == f or name.startswith(f + ".") for f in forbidden)


class Refuse(importlib.abc.MetaPathFinder):
    """Refuses the forbidden modules, noting which of our modules asked (the innermost on the stack)."""

    def __init__(self) -> None:
        self.forbidden: tuple[str, ...] = ()
        self.attempts: list[dict[str, str]] = []

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001
        if not _forbidden(fullname, self.forbidden):
            return None
        frame = sys._getframe(1)
        while frame is not None and not str(frame.f_globals.get("__name__", "")).startswith(OURS):
            frame = frame.f_back
        importer = frame.f_globals["__name__"] if frame is not None else "?"
        self.attempts.append({"module": fullname, "importer": importer})
        raise ImportError(f"`{fullname}` may not be loaded here (imported by {importer})")


def modules_of(pattern: str) -> list[str]:
    """``x``: that module; ``x.*``: the package and every module below it."""
    if not pattern.endswith(".*"):
        return [pattern]
    package = pattern[:-2]
    module = importlib.import_module(package)
    return [package, *sorted(info.name for info in pkgutil.walk_packages(module.__path__, package + "."))]


def main() -> None:
    refuse = Refuse()
    sys.meta_path.insert(0, refuse)
    failures, leaked = [], []
    for patterns, forbidden in PHASES:
        refuse.forbidden = forbidden
        for pattern in patterns:
            try:
                names = modules_of(pattern)
            except ImportError:
                failures.append({"module": pattern, "error": traceback.format_exc(limit=-3)})
                continue
            for name in names:
                try:
                    importlib.import_module(name)
                except ImportError:
                    failures.append({"module": name, "error": traceback.format_exc(limit=-3)})
        leaked += [name for name in sys.modules if _forbidden(name, forbidden)]
    print(json.dumps({"attempts": refuse.attempts, "failures": failures, "leaked": sorted(set(leaked))}))


if __name__ == "__main__":
    main()
