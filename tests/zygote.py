"""Ranks forked from preloaded interpreters ("zygotes") instead of started fresh: each process of a launch then
skips importing torch, Lightning, transformers and this project (about 7 s of CPU each on 2 cores).

A zygote is ``python -m tests.zygote``, started once per test session by `tests/zygotes.py` (the session's side):
it imports `PRELOAD`, checks that it is still one thread with CUDA untouched, and then only forks.
Requests and answers are JSON lines on its stdin and stdout: ``{"argv", "env", "cwd", "log"}`` -> ``{"pid"}`` at
once, ``{"pid", "exit"}`` when that child ends (the zygote is its parent and reaps it). The child makes itself
what a fresh ``python -m tests.worker ...`` would be (`_become_fresh`): the rank's environment, working
directory, log file as stdout and stderr, what torch and Lightning read from the environment at import (the c10d
debug level, the rank-zero flag), seeds drawn afresh (torch, numpy; Python's `random` reseeds itself after a
fork), faulthandler as ``PYTHONFAULTHANDLER`` says; then it runs the module as ``__main__`` and exits as an
interpreter would (non-daemon threads joined, atexit handlers run). A zygote dies with its test session, a
rank with its zygote.

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
import sys
import threading
import traceback

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
           "tests.models", "tests.distributed.parity_ranks", "tests.distributed.family_models")
"""What the ranks import, less what reads the environment when imported: the scenario modules (several read
``WORLD_SIZE`` at import) are imported by each rank."""


def _die_with_parent() -> None:
    """SIGKILL this process when its parent ends (Linux), so a killed test session leaves no zygote or rank."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


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
    _die_with_parent()
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
    _die_with_parent()
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


if __name__ == "__main__":
    serve()
