"""mypy, as `pyproject.toml` configures it, passes on the strategy and the diagnostics' records: every module of
ours they import is checked with them (third-party packages are followed silently). The first run starts from an
empty cache, as on a clean checkout; the second, on a copy with one wrong type in a module the strategy imports,
shows that such a module's errors count."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("mypy", reason="mypy is a dev dependency: pip install -e '.[dev]'")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mypy-cache")


def _mypy(where: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache)], cwd=where,
                          capture_output=True, text=True, timeout=600)


def test_mypy_passes_on_the_strategy_and_the_records(cache: Path) -> None:
    result = _mypy(ROOT, cache)
    assert result.returncode == 0, result.stdout + result.stderr
    checked = int(result.stdout.split(" source files")[0].rsplit(" ", 1)[-1])
    files = [*(ROOT / "lightning_nd" / "strategy").glob("*.py"), *(ROOT / "diagnostics" / "records").glob("*.py")]
    assert "no issues found" in result.stdout and checked == len(files), result.stdout


def test_an_error_in_a_module_the_strategy_imports_counts(cache: Path, tmp_path: Path) -> None:
    for part in ("lightning_nd", "diagnostics"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    wrong = tmp_path / "lightning_nd" / "mesh" / "dims.py"
    wrong.write_text(wrong.read_text() + "\n\ndef _typed_wrong() -> int:\n    return 'not an int'\n")
    result = _mypy(tmp_path, cache)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "lightning_nd/mesh/dims.py" in result.stdout and "Incompatible return value" in result.stdout, result.stdout
