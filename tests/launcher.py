"""Run a function on N real processes (gloo on CPU) and collect what each rank returns.

Each rank is its own ``python -m tests.worker`` subprocess with the torchrun-style environment
Lightning recognises, so a `Trainer(devices=N)` inside it never re-launches pytest (FIELD-NOTES.md).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(target: str, world_size: int, out_dir: Path, timeout: float = 600, **kwargs: Any) -> list[Any]:
    """Run ``target`` ("module:function") with ``kwargs`` on ``world_size`` ranks; returns each rank's result.

    Raises with every rank's output tail when a rank fails or the run exceeds ``timeout`` seconds.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world_size),
            "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "LOCAL_WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        log = open(out_dir / f"rank{rank}.log", "w")
        cmd = [sys.executable, "-m", "tests.worker", target, json.dumps(kwargs), str(out_dir)]
        procs.append((subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log))
    failed = _wait_all([proc for proc, _ in procs], timeout)
    for _, log in procs:
        log.close()
    if failed:
        tails = "\n".join(
            f"--- rank {rank} ---\n" + (out_dir / f"rank{rank}.log").read_text()[-3000:] for rank in range(world_size)
        )
        raise RuntimeError(f"{target} failed on ranks {failed}:\n{tails}")
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def _wait_all(procs: list[subprocess.Popen], timeout: float, grace: float = 10.0) -> list[int]:
    """Wait for every rank; once one fails give the others ``grace`` seconds, then kill what still runs."""
    deadline = time.monotonic() + timeout
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        if any(proc.poll() not in (None, 0) for proc in procs):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.1)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return [rank for rank, proc in enumerate(procs) if proc.returncode != 0]
