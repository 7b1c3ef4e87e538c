"""LitGPT is installed beside `transformers` without moving it: the README's test command installs `litgpt` with
``--no-deps`` (its own pins, ``huggingface-hub<1.4``, exclude what the installed `transformers` needs), and its model
needs only torch and `psutil` (in ``.[dev]``). Both import, and `transformers`' own dependency check passes."""

from __future__ import annotations

import importlib.util

import pytest

INSTALL = "`.venv/bin/pip install --no-deps litgpt==0.5.13` (the README's test command does)"


def test_litgpt_and_transformers_both_import_and_transformers_keeps_its_dependencies():
    if importlib.util.find_spec("litgpt") is None:
        pytest.fail(f"litgpt is not installed, so the LitGPT parity cases would not run: {INSTALL}")
    import litgpt.model
    import transformers
    from transformers.dependency_versions_check import dep_version_check

    dep_version_check("huggingface-hub")  # raises when the installed hub is outside transformers' range
    assert litgpt.model.GPT.__module__ == "litgpt.model" and transformers.__version__
