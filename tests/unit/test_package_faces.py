"""Each package of `lightning_nd` names its one or two entry points in ``__all__`` (a few for the checkpoint and the
check, which are used from outside as a set) and each name resolves; the technique packages import them on first use,
so importing a package loads none of its modules (the import probe checks the pure ones load no pipelining)."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import lightning_nd

REPO = Path(__file__).resolve().parents[2]
SETS = {"lightning_nd.checkpoint": 11, "lightning_nd.check": 4}
"""Packages whose face is a set of functions used together, and its size."""
ALIASES = {"lightning_nd.plan"}
"""The planner's first name: a package only so that ``python -m lightning_nd.plan`` runs."""


def packages() -> list[str]:
    return sorted(info.name for info in pkgutil.walk_packages(lightning_nd.__path__, "lightning_nd.") if info.ispkg)


def test_every_package_names_its_entry_points_and_each_resolves():
    found = packages()
    assert {"lightning_nd.tensor_parallel", "lightning_nd.pipeline_parallel", "lightning_nd.mesh"} <= set(found)
    for name in found:
        if name in ALIASES:
            continue
        package = importlib.import_module(name)
        names = getattr(package, "__all__", None)
        assert names and 1 <= len(names) <= SETS.get(name, 2), (name, names)
        for entry in names:
            assert getattr(package, entry) is not None, (name, entry)


def test_importing_a_technique_package_loads_none_of_its_modules():
    code = ("import sys, lightning_nd.tensor_parallel, lightning_nd.pipeline_parallel, lightning_nd.context_parallel;"
            " print(sorted(m for m in sys.modules if m.startswith(('lightning_nd.tensor_parallel.',"
            " 'lightning_nd.pipeline_parallel.', 'lightning_nd.context_parallel.'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
