"""The memory test's real out-of-memory fault (`tests/distributed/memory_ranks.py`) in a script run as a user runs it,
by Lightning's own launcher or by torchrun:

    python tests/e2e/oom_script.py <folder> [victim]
    python -m torch.distributed.run --nproc-per-node=4 tests/e2e/oom_script.py <folder> [victim]

pp=2 x dp_shard=2 on 4 CPU processes with `MemoryMonitor`; ``victim`` (default 1, stage 0) asks the allocator for 1 PiB
in step 2's forward. Every rank should leave ``<folder>/diagnostics/memory-rank<R>.json``; ``<folder>/stamp`` is
written just before the allocation. `run` starts it under either launcher from outside and reports what came out
(`tests/e2e/test_reports_before_kill.py`, `benchmarks/reports_before_kill.py`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from diagnostics import MemoryMonitor  # noqa: E402
from lightning_nd import NDParallel  # noqa: E402
from tests.distributed.memory_ranks import OOM_STEP, TIMEOUT_S, train_into_oom  # noqa: E402


def main(folder: str, victim: int) -> None:
    trainer = Trainer(strategy=NDParallel(pp=2, dp_shard=2, timeout=TIMEOUT_S), accelerator="cpu", devices=4,
                      max_steps=OOM_STEP + 2, callbacks=[MemoryMonitor(log_dir=folder)],
                      logger=TensorBoardLogger(folder, name="tb"), enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      num_sanity_val_steps=0)
    train_into_oom(trainer, victim, str(Path(folder) / "stamp"))


LAUNCHERS = {
    "lightning": [sys.executable, __file__],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", __file__],
}
"""How each launcher starts the script: Lightning's own (`Trainer(devices=4)` re-runs it as ranks 1-3), torchrun."""
MARK = "OOM_SCRIPT_RUN"


@dataclass(frozen=True)
class Outcome:
    code: int
    """The launching command's exit status."""
    cards: dict[int, dict[str, Any]]
    """Each rank's ``memory-rank<R>.json`` that was written, by rank."""
    fault_to_last_exit_s: float | None
    """From the allocation to the exit of the last process of the run (None: the fault never came)."""
    output: str


def run(launcher: str, folder: Path, victim: int = 1, timeout: float = 300) -> Outcome:
    """Run the script under ``launcher`` (a key of `LAUNCHERS`) into ``folder``; every process it starts carries a
    mark in its environment, so the last exit is seen also of a rank its launcher left behind."""
    folder.mkdir(parents=True, exist_ok=True)
    mark = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", MARK: mark}
    deadline = time.monotonic() + timeout
    with open(folder / "output.txt", "w") as output:
        launched = subprocess.Popen([*LAUNCHERS[launcher], str(folder), str(victim)], cwd=REPO, env=env, stdout=output,
                                    stderr=subprocess.STDOUT)
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.05)
        last_exit = time.time()
        for pid in _marked(mark):  # still running after ``timeout``: the caller sees that in the exit status
            os.kill(pid, signal.SIGKILL)
        code = launched.wait()
    stamp = folder / "stamp"
    cards = {rank: json.loads(path.read_text()) for rank in range(4)
             if (path := folder / "diagnostics" / f"memory-rank{rank}.json").is_file()}
    return Outcome(code, cards, last_exit - stamp.stat().st_mtime if stamp.is_file() else None,
                   (folder / "output.txt").read_text())


def _marked(mark: str) -> list[int]:
    """The live (not zombie) processes that carry ``mark`` in their environment."""
    needle, found = f"{MARK}={mark}".encode(), []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and needle in (proc / "environ").read_bytes().split(b"\0") and \
                    (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
