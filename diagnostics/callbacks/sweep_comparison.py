"""`CompareSweep`: a Hydra callback that ends a sweep (``examples/train.py -m ...``) with its answer: after the last
job, the comparison of every run (``python -m diagnostics compare`` on the sweep's folder) is printed and written
beside the runs. A sweep whose runs all failed exits with status 1 after the table."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback

from diagnostics.analysis.compare import compare
from diagnostics.records import find_runs
from diagnostics.report.compare_card import MARKDOWN_FILE, write_comparison

log = logging.getLogger(__name__)


def first_process() -> bool:
    """Rank 0's process (Lightning starts the others with ``LOCAL_RANK`` set; torchrun sets ``RANK``)."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK"))


class CompareSweep(HydraCallback):
    def __init__(self, tensorboard: bool = True) -> None:
        """``tensorboard``: also write the table as a TensorBoard card in ``<sweep dir>/compare``."""
        self.tensorboard = tensorboard

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if not first_process():
            return  # another rank's process: Lightning starts it with the sweep's arguments, it runs the sweep too
        folder = Path(config.hydra.sweep.dir)
        jobs = [path for path in folder.iterdir() if (path / ".hydra").is_dir()] if folder.is_dir() else []
        if len(jobs) == 1 and (jobs[0] / MARKDOWN_FILE).is_file():
            return  # a sweep of one layout search: its job compared its own runs and printed the table already
        comparison = compare(find_runs(folder)) if folder.is_dir() else None
        if comparison is None or not comparison.rows:
            log.warning("lightning-nd CompareSweep: no run under %s to compare", folder)
            return
        print("\n" + write_comparison(folder, comparison, tensorboard=self.tensorboard), flush=True)
        if comparison.best is None:
            sys.exit(1)
