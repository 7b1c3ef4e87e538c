"""The docs' map of the code: every `lightning_nd/` and `diagnostics/` path the README and the docs name exists, every
dotted `lightning_nd.` path they name imports from where it lives now (no moved alias), and the design notes' feature
table finds each technique in a folder named for it and each step in a file (or folder) named for the step.

A run's outputs and TensorBoard tags share the `diagnostics/` prefix (`diagnostics/traces/`, the card
`diagnostics/hang`), so under `diagnostics/` only a `.py` file or a folder of the package counts as a path of ours;
a markdown link (`[hangs](diagnostics/hangs.md)`) is a page, which MkDocs' strict build checks."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from tests.unit.dotted import resolve

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs" / "pages").rglob("*.md"))]
PATH = re.compile(r"(?<![\w/.<>(-])((?:lightning_nd|diagnostics)/[\w/.]*\w/?)")
DOTTED = re.compile(r"(?<![\w/.])(lightning_nd(?:\.[A-Za-z_]\w*)+)(?!\w)")
FILE_NAMES = (".json", ".py", ".md", ".yaml")  # `lightning_nd.json` is the checkpoint's manifest, a file name
# concept -> (the folder under lightning_nd/ or diagnostics/ that names the technique or concern, the step's name)
CONCEPTS = {
    "the N-D mesh built": ("mesh", "build"),
    "FSDP / HSDP / ZeRO applied": ("parallel", "fsdp"),
    "a Hugging Face model's TP plan inferred": ("tensor_parallel", "infer"),
    "a TP style applied to a module": ("tensor_parallel", "apply"),
    "pipeline stages split": ("pipeline_parallel", "split"),
    "ring attention": ("context_parallel", "ring_attention"),
    "the hang verdict": ("analysis", "hang"),
    "the memory cost model": ("cost", "memory"),
}


def _named(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    return sorted({(doc.relative_to(REPO).as_posix(), found) for doc in DOCS
                   for found in pattern.findall(doc.read_text())})


def _ours(path: str) -> bool:
    first = REPO / Path(path).parts[0] / Path(path).parts[1]
    return path.startswith("lightning_nd/") or path.endswith(".py") or (first / "__init__.py").exists()


def test_every_path_the_docs_name_exists():
    named = [(doc, path) for doc, path in _named(PATH) if _ours(path)]
    assert len(named) > 50, named
    missing = [(doc, path) for doc, path in named if not (REPO / path.rstrip("/.")).exists()]
    assert not missing, missing


def test_every_dotted_path_the_docs_name_imports_from_its_home():
    named = [(doc, dotted) for doc, dotted in _named(DOTTED) if not dotted.endswith(FILE_NAMES)]
    assert len(named) > 10, named
    failed = []
    for doc, dotted in named:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # an old path still imports, but the docs name the new
            if resolve(dotted) is None:
                failed.append((doc, dotted))
    assert not failed, failed


def _table() -> dict[str, str]:
    text = (REPO / "docs" / "pages" / "design.md").read_text()
    rows = re.findall(r"^\| (.+?) \| (.+?) \|$", text, flags=re.M)
    return {feature: files for feature, files in rows if feature not in ("Feature", "---")}


@pytest.mark.parametrize("concept", CONCEPTS)
def test_the_feature_table_finds_each_concept_in_one_guess(concept):
    folder, step = CONCEPTS[concept]
    table = _table()
    assert concept in table, sorted(table)
    first = PATH.search(table[concept])
    assert first is not None, table[concept]
    parts = Path(first.group(1)).parts
    assert parts[1] == folder and Path(parts[2]).stem == step, (concept, first.group(1))
    assert (REPO / first.group(1)).exists(), first.group(1)
