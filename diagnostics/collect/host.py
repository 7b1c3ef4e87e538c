"""Where this process runs: its host, the CPU cores it may run on, and its GPU (for `host_load`'s check that no two
ranks share a core or a GPU)."""

from __future__ import annotations

import os
import socket

import torch

from lightning_nd.cost.hardware import PRESETS


def host_processors(device: torch.device) -> tuple[str, frozenset[int], str | None]:
    """(host name, the CPU cores this process may run on, its GPU's UUID on CUDA else None)."""
    cores = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset(
        range(os.cpu_count() or 1))
    gpu = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
    return socket.gethostname(), cores, gpu


def device_preset(device: torch.device, given: str | None = None) -> str | None:
    """The cost model's hardware preset for ``device``: ``given`` when set, ``cpu`` on CPU, the preset a CUDA
    device's name contains (``h100`` in "NVIDIA H100 80GB HBM3"), else None."""
    if given is not None:
        return given
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return next((preset for preset in PRESETS if preset in name), None)


Place = tuple[str, frozenset[int], "str | None"]


def host_shares(places: list[Place]) -> tuple[dict[int, str], dict[str, int], dict[str, tuple[int, ...]]]:
    """Every rank's `host_processors` (by rank) as: rank -> host, host -> the cores its processes may run on (the
    union of their affinity), and each GPU more than one rank uses -> those ranks."""
    hosts = {rank: host for rank, (host, _, _) in enumerate(places)}
    cores = {host: len(frozenset().union(*(mine for h, mine, _ in places if h == host))) for host in set(hosts.values())}
    users: dict[str, list[int]] = {}
    for rank, (_, _, gpu) in enumerate(places):
        if gpu is not None:
            users.setdefault(gpu, []).append(rank)
    return hosts, cores, {gpu: tuple(ranks) for gpu, ranks in users.items() if len(ranks) > 1}
