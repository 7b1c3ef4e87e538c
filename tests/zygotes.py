"""The test session's side of the zygotes (`tests/zygote.py`): start them, ask them for ranks, learn how each rank
ended. `tests/launcher.py` asks `Zygotes.fork` for every rank and starts a fresh process where it answers None.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import warnings

from tests.zygote import PRELOAD, RANK_VARIABLES, SLOTS


class Rank:
    """One forked rank, as much of `subprocess.Popen` as the launcher uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid

    @property
    def returncode(self) -> int | None:
        return self.zygote.exits.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.zygote.ended:
            if not self.zygote.ended.wait_for(lambda: self.pid in self.zygote.exits or self.zygote.gone, timeout):
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0)
        if self.pid not in self.zygote.exits:
            raise RuntimeError(f"the zygote of rank process {self.pid} ended; its exit code is unknown")
        return self.zygote.exits[self.pid]

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Zygote:
    """The test session's side of one zygote: start it, ask it for ranks, learn how they ended."""

    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "tests.zygote", json.dumps(PRELOAD)],
                                        env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.exits: dict[int, int] = {}
        self.ended = threading.Condition()
        self.gone = False
        self._pids: list[int] = []
        self._ready: dict | None = None
        threading.Thread(target=self._read, daemon=True, name="zygote-answers").start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            answer = json.loads(line)
            with self.ended:
                if "ready" in answer:
                    self._ready = answer
                elif "exit" in answer:
                    self.exits[answer["pid"]] = answer["exit"]
                else:
                    self._pids.append(answer["pid"])
                self.ended.notify_all()
        with self.ended:
            self.gone = True
            self.ended.notify_all()

    def ready(self, timeout: float = 600) -> bool:
        with self.ended:
            self.ended.wait_for(lambda: self._ready is not None or self.gone, timeout)
        return bool(self._ready and self._ready["ready"])

    def fork(self, argv: list[str], env: dict[str, str], cwd: str, log: str) -> Rank:
        assert self.process.stdin is not None
        with self.ended:
            self.process.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": cwd, "log": log}) + "\n")
            self.process.stdin.flush()
            if not self.ended.wait_for(lambda: self._pids or self.gone, 120) or not self._pids:
                raise RuntimeError("the zygote did not fork the rank")
            return Rank(self, self._pids.pop(0))

    def close(self) -> None:
        if self.process.poll() is None and self.process.stdin is not None:
            self.process.stdin.close()  # the zygote kills what still runs and exits
            self.process.wait(timeout=60)


class Zygotes:
    """`SLOTS` zygotes, started together on first use; `fork` gives None where a rank must start fresh."""

    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self.env, self.cwd = env, cwd
        self._zygotes: list[Zygote] | None = None
        self.refused: str | None = None

    def fork(self, rank: int, argv: list[str], env: dict[str, str], log: str) -> Rank | None:
        differs = sorted(name for name in {*env, *self.env} - set(RANK_VARIABLES) if env.get(name) != self.env.get(name))
        if differs:
            warnings.warn(f"Rank {rank} starts as a fresh process: its environment differs from the zygotes' in"
                          f" {', '.join(differs)}.", stacklevel=3)
        if differs or self.refused:
            return None
        if self._zygotes is None:
            self._zygotes = [Zygote(self.env, self.cwd) for _ in range(SLOTS)]
            atexit.register(self.close)
            if not all(zygote.ready() for zygote in self._zygotes):
                self.refused = "a zygote is not a single thread after its imports, or touched CUDA"
                warnings.warn(f"Ranks start as fresh processes: {self.refused}.", stacklevel=2)
                self.close()
                return None
        return self._zygotes[rank % SLOTS].fork(argv, env, self.cwd, log)

    def close(self) -> None:
        for zygote in self._zygotes or ():
            zygote.close()
