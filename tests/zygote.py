"""Ranks forked from preloaded interpreters ("zygotes") instead of started fresh: each process of a launch then
skips importing torch, Lightning, transformers and this project (about 7 s of CPU each on 2 cores).

A zygote is ``python -m tests.zygote`` started once per test session: it imports `preload_modules()`, checks that
it is still one thread with CUDA untouched, and then only forks. Requests and answers are JSON lines on its stdin
and stdout: ``{"argv", "env", "cwd", "log"}`` -> ``{"pid"}`` at once, ``{"pid", "exit"}`` when that child ends
(the zygote is its parent and reaps it). The child makes itself what a fresh ``python -m tests.worker ...`` would
be (`_become_fresh`): the rank's environment, working directory, log file as stdout and stderr, what torch and
Lightning read from the environment at import (the c10d debug level, the rank-zero flag), seeds drawn afresh
(torch, numpy; Python's `random` reseeds itself after a fork),
faulthandler as ``PYTHONFAULTHANDLER`` says; then it runs the module as ``__main__`` and exits as an interpreter
would (non-daemon threads joined, atexit handlers run).

Why forking here is safe: the fork happens in a process with one thread (checked), so no lock is held by a
thread that would not exist in the child; OpenMP and torch's thread pools start on first use, which the zygote
never reaches (``OMP_NUM_THREADS`` is fixed at its start, as the launcher fixes it for every rank); no process
group, gloo context or store exists before the child makes its own; CUDA is never initialised in the zygote
(checked before every fork), so a child may initialise it. Each of `SLOTS` zygotes is a fresh interpreter with
its own hash seed, and rank r forks from zygote r % SLOTS, so ranks of one launch iterate sets differently, as
separate processes do.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import json
import os
import runpy
import selectors
import signal
import subprocess
import sys
import threading
import traceback
import warnings

SLOTS = 4
"""Zygotes kept by a test session (rank r forks from zygote r % SLOTS)."""
RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
                  "PYTHONFAULTHANDLER", "TORCH_DISTRIBUTED_DEBUG", "PYTEST_CURRENT_TEST")
"""The environment a rank may have apart from its zygote's: nothing reads these at import, or the fork reads them
again (`_become_fresh`). A rank whose environment differs in anything else (a variable torch reads at import,
say) starts as a fresh process, with a warning naming the variables."""
PRELOAD = ("torch", "torch.distributed.pipelining", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch.distributed.tensor.parallel", "torch.profiler", "torch._dynamo", "torch._inductor.compile_fx",
           "lightning.pytorch", "transformers", "hydra",
           "lightning_nd.strategy.nd_parallel", "lightning_nd.parallel.compose", "lightning_nd.checkpoint",
           "diagnostics.callbacks.bottleneck_monitor", "diagnostics.callbacks.collective_monitor",
           "diagnostics.callbacks.memory_monitor", "diagnostics.callbacks.layout", "examples.lit", "examples.data",
           "tests.models", "tests.distributed.parity", "tests.distributed.families")
"""What the ranks import, less what reads the environment when imported: the scenario modules (several read
``WORLD_SIZE`` at import) are imported by each rank."""


def preload_modules() -> list[str]:
    return list(PRELOAD)


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _become_fresh(request: dict) -> None:
    """This forked child as a fresh interpreter started with the request's environment would be."""
    signal.set_wakeup_fd(-1)
    for number in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(file=sys.stderr, all_threads=True)
    else:
        faulthandler.disable()
    import numpy
    import torch
    import torch.distributed
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    torch.distributed.set_debug_level_from_env()
    rank_zero_only.rank = _get_rank() or 0
    torch.seed()  # a fresh interpreter seeds torch's generator from the OS; forked ranks would share one seed
    numpy.random.seed()


def _run_child(request: dict) -> None:
    code: int = 0
    try:
        _become_fresh(request)
        module, sys.argv = request["argv"][0], request["argv"][1:]
        sys.argv.insert(0, module)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  (as the interpreter: print it, exit 1)
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # noqa: SLF001  (an interpreter joins non-daemon threads before atexit)
        atexit._run_exitfuncs()  # noqa: SLF001
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def serve() -> None:
    requests = os.fdopen(os.dup(0), "r")
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)  # what the imports print goes to the zygote's stderr, never into the answers
    for name in json.loads(sys.argv[1]):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  (the child imports it again and fails as a fresh process would)
            traceback.print_exc()
    threads = _threads()
    answers.write(json.dumps({"ready": threads == 1 and not _cuda_initialised(), "threads": threads}) + "\n")
    answers.flush()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    children: set[int] = set()
    while True:
        for key, _ in selector.select():
            if key.fileobj is requests:
                line = requests.readline()
                if not line:  # the test session ended: nothing may outlive it
                    for pid in children:
                        os.kill(pid, signal.SIGKILL)
                    return
                assert _threads() == 1 and not _cuda_initialised()
                answers.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    for inherited in (requests, answers):
                        inherited.close()
                    for fd in (wake_read, wake_write):
                        os.close(fd)
                    _run_child(json.loads(line))
                children.add(pid)
                answers.write(json.dumps({"pid": pid}) + "\n")
            else:
                os.read(wake_read, 4096)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            answers.write(json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()



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
        self.env = env
        self.process = subprocess.Popen([sys.executable, "-m", "tests.zygote", json.dumps(preload_modules())],
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


if __name__ == "__main__":
    serve()
