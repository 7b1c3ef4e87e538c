"""`examples/train.py` as one rank of a run started the way torchrun starts one (`tests/e2e/test_train.py`): the
script's own ``__main__`` with its Hydra command line, in a process the launcher made."""

from __future__ import annotations

import runpy
import sys

from tests.launcher import REPO


def run(argv: list[str]) -> None:
    sys.argv = [str(REPO / "examples" / "train.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")
