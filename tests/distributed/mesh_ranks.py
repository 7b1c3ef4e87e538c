"""Run on each of 8 ranks: build meshes for several layouts and report every named group's ranks."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist

from lightning_nd.mesh.build import build_mesh
from lightning_nd.mesh.dims import ParallelDims


def group_ranks(layouts: list[dict[str, int]]) -> list[dict[str, Any]]:
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    reports = []
    for sizes in layouts:
        mesh = build_mesh(ParallelDims(**sizes, world_size=world), "cpu")
        reports.append({
            **{name: mesh.ranks(name) for name in mesh.names},
            "local_rank": {name: mesh.local_rank(name) for name in mesh.names},
        })
    return reports
