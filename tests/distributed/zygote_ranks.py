"""What a rank process looks like from inside (`tests/distributed/test_zygote.py`): its identity, what it took
from the environment, its random state; and the ways a process can end."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

import numpy
import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only


def describe() -> dict:
    print(f"rank {os.environ['RANK']} to stdout")
    print(f"rank {os.environ['RANK']} to stderr", file=sys.stderr)
    return {
        "rank": int(os.environ["RANK"]), "rank_zero_only": rank_zero_only.rank, "hash": hash("lightning-nd"),
        "initial_seed": torch.initial_seed(), "torch_draw": torch.rand(4), "numpy_draw": float(numpy.random.rand()),
        "faulthandler": faulthandler.is_enabled(), "debug_level": str(dist.get_debug_level()),
        "threads": torch.get_num_threads(), "argv": list(sys.argv), "main": sys.modules["__main__"].__name__,
        "cwd": os.getcwd(), "cuda_initialised": torch.cuda.is_initialized(),
    }


def end(how: str) -> None:
    print("before the end", flush=True)
    if how == "exit_3":
        sys.exit(3)
    if how == "raise":
        raise RuntimeError("raised in the rank")
    if how == "os_exit_5":
        os._exit(5)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
