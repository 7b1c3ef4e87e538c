"""The package's shape holds: the pure layers import no Lightning and no file grows past ~300 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_nd"
DIAGNOSTICS = PACKAGE.parent / "diagnostics"
PURE = ("layout", "parallel", "runtime", "nn", "checkpoint")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", PURE)
def test_pure_layers_import_no_lightning_and_no_strategy(layer):
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        bad = {name for name in _imports(path) if name.split(".")[0] in ("lightning", "pytorch_lightning")
               or name.startswith("lightning_nd.strategy")}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


def test_diagnostic_analyses_are_pure_functions_over_records():
    """No Lightning, no torch (so no process group): they run offline on what a failed run left."""
    for path in sorted((DIAGNOSTICS / "analysis").rglob("*.py")):
        bad = {name for name in _imports(path) if name.split(".")[0] in ("lightning", "pytorch_lightning", "torch")}
        assert not bad, f"{path.relative_to(DIAGNOSTICS)} imports {sorted(bad)}"


def test_no_file_over_300_lines():
    files = [*PACKAGE.rglob("*.py"), *DIAGNOSTICS.rglob("*.py")]
    long = {str(p.relative_to(PACKAGE.parent)): n for p in files if (n := len(p.read_text().splitlines())) > 300}
    assert not long, long
