"""No file of the packages grows past ~300 lines (one concept per file). The direction of imports is checked by
`test_import_contracts.py`."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_nd"
DIAGNOSTICS = PACKAGE.parent / "diagnostics"


def test_no_file_over_300_lines():
    files = [*PACKAGE.rglob("*.py"), *DIAGNOSTICS.rglob("*.py")]
    long = {str(p.relative_to(PACKAGE.parent)): n for p in files if (n := len(p.read_text().splitlines())) > 300}
    assert not long, long
