"""Imports run one way, checked two ways: import-linter's contracts (``pyproject.toml``) over the source, every
function-level import included, and a fresh interpreter importing every module of the pure layers
(`import_probe.py`: no Lightning, no transformers, no pipelining in layout/cost/plan, no torch in the analyses).
Both are also run on a copy of the packages holding a fixture module that breaks them (`import_fixtures/`), and
must fail there. ``Trainer(strategy="nd")`` works after ``import lightning_nd`` in either order with Lightning."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("import_probe.py")
FIXTURES = Path(__file__).with_name("import_fixtures")
LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def _run(args: list[str], root: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """A fresh interpreter that finds the packages under ``root`` first."""
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


def lint(root: Path) -> subprocess.CompletedProcess:
    return _run(["-c", LINT, "--config", str(root / "pyproject.toml"), "--no-cache"], root)


def probe(root: Path) -> dict:
    done = _run([str(PROBE)], root)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> Path:
    """A copy of the packages with both fixtures: the layout importing the strategy, a cost module Lightning."""
    root = tmp_path_factory.mktemp("broken")
    for package in ("lightning_nd", "diagnostics"):
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root)
    shutil.copy(FIXTURES / "upward_import.py", root / "lightning_nd" / "layout")
    shutil.copy(FIXTURES / "lightning_import.py", root / "lightning_nd" / "cost")
    return root


def test_the_import_contracts_hold():
    done = lint(REPO)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_the_pure_layers_load_no_lightning_transformers_or_pipelining():
    found = probe(REPO)
    assert found == {"attempts": [], "failures": [], "leaked": []}, json.dumps(found, indent=1)


def test_the_contracts_fail_on_an_upward_import_and_on_lightning_in_a_pure_layer(broken):
    done = lint(broken)
    assert done.returncode != 0, done.stdout[-3000:]
    report = done.stdout.split("Broken contracts", 1)[-1]
    assert "lightning_nd.layout is not allowed to import lightning_nd.strategy" in report, report
    assert "lightning_nd.layout.upward_import -> lightning_nd.strategy.nd_parallel" in report, report
    assert "lightning_nd.cost is not allowed to import lightning" in report, report
    assert "lightning_nd.cost.lightning_import -> lightning" in report, report


def test_the_import_probe_fails_on_both_fixtures(broken):
    found = probe(broken)
    failed = {failure["module"]: failure["error"] for failure in found["failures"]}
    assert "`lightning` may not be loaded here" in failed.get("lightning_nd.layout.upward_import", ""), found
    assert "`lightning` may not be loaded here" in failed.get("lightning_nd.cost.lightning_import", ""), found
    assert {"module": "lightning", "importer": "lightning_nd.cost.lightning_import"} in found["attempts"]


REGISTRY = """
import {first}, {second}
from lightning.pytorch import Trainer
trainer = Trainer(accelerator="cpu", devices=4, strategy="nd", logger=False, enable_progress_bar=False)
print(type(trainer.strategy).__name__, trainer.strategy.dims.dp_shard)
"""


def test_strategy_nd_after_import_lightning_nd_in_either_order():
    """Fresh interpreters: the registration waits for Lightning's strategies, or finds them loaded already."""
    orders = (("lightning_nd", "lightning.pytorch"), ("lightning.pytorch", "lightning_nd"))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    runs = [subprocess.Popen([sys.executable, "-c", REGISTRY.format(first=a, second=b)], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a, b in orders]
    for order, run in zip(orders, runs):
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, (order, err[-3000:])
        assert out.split() == ["NDParallel", "4"], (order, out, err[-2000:])
