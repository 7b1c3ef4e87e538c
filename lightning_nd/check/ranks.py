"""Which ranks `--check` runs: enough to meet every distinct setup and step, and every rank they wait for.

Ranks on one pipeline stage build the same modules; they differ only in which shard of each tensor they hold, and
the first and the last coordinate on every other dim hold the extreme shards (an uneven split leaves the last one
short). Pipeline stages differ in everything. So the check runs every stage at all coordinates 0, and again at all
coordinates last when the Layout says a rank there holds shards of other shapes. A stage waits for objects from the
stages beside it on its own coordinates, so each checked pipeline is whole.
"""

from __future__ import annotations

from lightning_nd.layout.dims import MESH_DIMS
from lightning_nd.layout.record import Layout


def pipelines_to_check(layout: Layout) -> list[list[int]]:
    """The global ranks of each checked pipeline, stage 0 first: one, or two when shard shapes differ."""
    sizes = {name: layout.dims[name] for name in MESH_DIMS}
    corners = [{name: 0 for name in MESH_DIMS if name != "pp"},
               {name: sizes[name] - 1 for name in MESH_DIMS if name != "pp"}]
    pipelines: list[list[int]] = []
    for corner in corners:
        ranks = [_rank({**corner, "pp": stage}, sizes) for stage in range(sizes["pp"])]
        if not pipelines or any(_shapes(layout, rank) != _shapes(layout, first)
                                for rank, first in zip(ranks, pipelines[0])):
            pipelines.append(ranks)
    return pipelines


def _shapes(layout: Layout, rank: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(param.name, param.local_shape) for param in layout.rank(rank).params]


def _rank(coordinates: dict[str, int], sizes: dict[str, int]) -> int:
    rank = 0
    for name in MESH_DIMS:
        rank = rank * sizes[name] + coordinates[name]
    return rank
