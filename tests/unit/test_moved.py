"""Modules that moved keep importing under their old dotted paths (`lightning_nd/moved.py`): every path the README,
the docs and the examples named at c4b0ff6 (`tests/data/dotted_paths_c4b0ff6.txt`, those that imported then, plus
`lightning_nd.nn.MoE`, which the docs named and which did not), each old module warning once with its new path and
being the new module itself; the public API and `lightning_nd.nn.moe.MoE` import without a warning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_nd.moved import MOVED

REPO = Path(__file__).resolve().parents[2]
NAMED = (REPO / "tests" / "data" / "dotted_paths_c4b0ff6.txt").read_text().split()
QUIET = ["lightning_nd.NDParallel", "lightning_nd.plan_layout", "lightning_nd.nn.moe.MoE", "lightning_nd.nn.MoE",
         "lightning_nd.checkpoint.latest_checkpoint", "lightning_nd.cost.hardware"]
# A fresh interpreter imports each path twice (the longest module prefix, then the attributes), recording warnings.
PROBE = """
import json, sys, warnings
from tests.unit.dotted import resolve
with warnings.catch_warnings(record=True) as records:
    warnings.simplefilter("always")
    for _ in range(2):
        found = {dotted: getattr(resolve(dotted), "__name__", None) for dotted in sys.argv[1:]}
    caught = [(r.category.__name__, str(r.message), r.filename) for r in records]
print(json.dumps({"found": found, "warnings": caught}))
"""


def _probe(paths: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *paths], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def result() -> dict:
    return _probe(sorted({*NAMED, *QUIET}))


def test_every_path_named_before_the_move_still_imports_and_an_old_module_warns_once(result):
    assert [path for path in NAMED if result["found"][path] is None] == []
    moved = [path for path in NAMED if path in MOVED]
    assert moved, "the recorded paths include moved modules"
    messages = [message for category, message, _ in result["warnings"] if category == "FutureWarning"]
    for path in moved:
        said = [message for message in messages if message.startswith(f"`{path}` moved")]
        assert said == [f"`{path}` moved to `{MOVED[path]}`; import it from there."], (path, messages)


def test_the_warning_points_at_the_line_that_imports_the_old_path():
    done = subprocess.run([sys.executable, "-c", "import lightning_nd.layout.dims"], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "<string>:1: FutureWarning: `lightning_nd.layout.dims` moved to `lightning_nd.mesh.dims`" in done.stderr


def test_the_public_api_and_the_moe_layer_import_without_a_warning(result):
    assert all(result["found"][path] is not None for path in QUIET), result["found"]
    others = [warning for warning in result["warnings"] if not any(warning[1].startswith(f"`{old}` moved")
                                                                   for old in MOVED)]
    assert others == [], others
    assert not any(path in MOVED or path.rpartition(".")[0] in MOVED for path in QUIET)


def test_an_old_module_is_the_new_one_and_every_move_is_real():
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for old, new in MOVED.items():
            assert importlib.import_module(old) is importlib.import_module(new), old
            assert not (REPO / (old.replace(".", "/") + ".py")).exists(), f"{old} is still a file: not moved"
