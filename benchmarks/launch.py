"""Run a benchmark script on N CPU processes: the script re-launches itself under torchrun.

    if __name__ == "__main__":
        run_on_ranks(main, world_size=4)

Outside a launcher this starts ``python -m torch.distributed.run --nproc-per-node N <script>`` and
returns its exit code; inside (RANK is set) it calls ``main()``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_on_ranks(main: Callable[[], None], world_size: int) -> None:
    if "RANK" in os.environ:
        main()
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
               sys.argv[0], *sys.argv[1:]]
    sys.exit(subprocess.run(command, env=env, cwd=REPO).returncode)
