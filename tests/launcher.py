"""Run a function on N real processes (gloo on CPU) and collect what each rank returns.

Each rank is its own process running ``python -m tests.worker`` with the torchrun-style environment Lightning
recognises, so a `Trainer(devices=N)` inside it never re-launches pytest (Lightning re-runs `sys.argv` in its child
processes on CPU). The processes are forked from preloaded zygotes (`tests/zygote.py`), which saves each rank its
imports; a rank whose environment the zygotes cannot give it starts fresh.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tests.zygote import RANK_VARIABLES
from tests.zygotes import Zygotes

REPO = Path(__file__).resolve().parents[1]
FRESH = "FRESH_RANKS"
"""Set (to anything) to start every rank as a fresh interpreter, as before the zygotes."""


_GIVEN: set[int] = set()
"""Ports `free_port` handed out in this process."""


def free_port() -> int:
    """A port free now and below the kernel's ephemeral range: rank 0 binds the store's port again for every
    `Trainer.fit` of a launch, and between two fits the gloo connections of the ranks (and of another pytest
    worker's) take ephemeral ports, one of which once took a port the kernel had handed out here (EADDRINUSE)."""
    low = _ephemeral_low()
    for port in random.sample(range(max(1024, low - 12000), low), 64):
        if port in _GIVEN:  # two daemons of one test (slurm_cluster.py) ask before either binds
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            _GIVEN.add(port)
            return port
    raise RuntimeError(f"No free port below the ephemeral range (from {low}). HINT: free some ports.")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def rank_environment(world_size: int, rank: int, port: str, environment: dict[str, str | None] | None) -> dict[str, str]:
    """A rank's environment: ours, the torchrun-style variables, one thread per rank; ``environment``: variables
    to set (None: to remove)."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world_size),
        "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    for name, value in (environment or {}).items():
        env.pop(name, None) if value is None else env.__setitem__(name, value)
    return env


_zygotes: Zygotes | None = None


def zygotes() -> Zygotes:
    """The session's zygotes, made for the environment every rank shares (`tests/zygote.py`)."""
    global _zygotes
    if _zygotes is None:
        shared = {k: v for k, v in rank_environment(1, 0, "0", None).items() if k not in RANK_VARIABLES}
        _zygotes = Zygotes(shared, str(REPO))
    return _zygotes


def start(target: str, world_size: int, out_dir: Path, environment: dict[str, str | None] | None = None,
          **kwargs: Any) -> list[tuple[Any, Any]]:
    """Start ``world_size`` ranks of ``target``; each rank's output goes to ``out_dir/rank<r>.log``. Each rank is
    forked from a zygote, or started fresh where its environment differs from theirs or with ``FRESH_RANKS=1``.
    Returns (process, open log file or None) per rank."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        env = rank_environment(world_size, rank, port, environment)
        log = out_dir / f"rank{rank}.log"
        argv = ["tests.worker", target, json.dumps(kwargs), str(out_dir)]
        proc = None if os.environ.get(FRESH) else zygotes().fork(rank, argv, env, str(log))
        if proc is not None:
            procs.append((proc, None))
            continue
        handle = open(log, "w")
        procs.append((subprocess.Popen([sys.executable, "-m", *argv], env=env, cwd=REPO, stdout=handle,
                                       stderr=subprocess.STDOUT), handle))
    return procs


def launch(target: str, world_size: int, out_dir: Path, timeout: float = 600, **kwargs: Any) -> list[Any]:
    """Run ``target`` ("module:function") with ``kwargs`` on ``world_size`` ranks; returns each rank's result.

    Raises with every rank's output tail when a rank fails or the run exceeds ``timeout`` seconds.
    """
    procs = start(target, world_size, out_dir, **kwargs)
    first, failed = _wait_all([proc for proc, _ in procs], timeout)
    for _, log in procs:
        if log is not None:
            log.close()
    if failed:
        codes = {rank: procs[rank][0].returncode for rank in failed}
        tails = "\n".join(_tail(out_dir / f"rank{rank}.log", rank, rank == first) for rank in range(world_size))
        raise RuntimeError(f"{target} failed: rank {first} first, exit codes {codes}:\n{tails}")
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def exits(procs: list[tuple[subprocess.Popen, Any]], timeout: float) -> dict[int, tuple[int, float]]:
    """Each rank's exit code and wall-clock exit time (``time.time()``), waiting at most ``timeout`` seconds; ranks
    still running then are killed and left out (the caller asserts on who is missing)."""
    ended: dict[int, tuple[int, float]] = {}
    deadline = time.monotonic() + timeout
    while len(ended) < len(procs) and time.monotonic() < deadline:
        for rank, (proc, _) in enumerate(procs):
            if rank not in ended and proc.poll() is not None:
                ended[rank] = (proc.returncode, time.time())
        time.sleep(0.05)
    for proc, log in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if log is not None:
            log.close()
    return ended


def _tail(log: Path, rank: int, first: bool) -> str:
    """The end of a rank's log; for the rank that failed first, also from its first traceback on."""
    text = log.read_text()
    start = text.find("Traceback") if first else -1
    body = text[start:start + 4000] + "\n[...]\n" if start >= 0 else ""
    return f"--- rank {rank}{' (failed first)' if first else ''} ---\n{body}{text[-3000:]}"


def _wait_all(procs: list[subprocess.Popen], timeout: float, grace: float = 10.0) -> tuple[int | None, list[int]]:
    """Wait for every rank; once one fails give the others ``grace`` seconds, then kill what still runs.

    Returns the rank that failed first (None on a timeout with no failure) and every failed rank.
    """
    deadline = time.monotonic() + timeout
    first = None
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        if first is None:
            first = next((rank for rank, proc in enumerate(procs) if proc.poll() not in (None, 0)), None)
            if first is not None:
                deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.1)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    failed = [rank for rank, proc in enumerate(procs) if proc.returncode != 0]
    if first is None and failed:
        first = next((rank for rank in failed if procs[rank].returncode > 0), failed[0])
    return first, failed
