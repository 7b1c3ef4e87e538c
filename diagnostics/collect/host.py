"""Where this process runs: its host, the CPU cores it may run on, and its GPU (for `host_load`'s check that no two
ranks share a core or a GPU)."""

from __future__ import annotations

import os
import socket

import torch


def host_processors(device: torch.device) -> tuple[str, frozenset[int], str | None]:
    """(host name, the CPU cores this process may run on, its GPU's UUID on CUDA else None)."""
    cores = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset(
        range(os.cpu_count() or 1))
    gpu = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
    return socket.gethostname(), cores, gpu
