"""Which ranks `--check` runs: enough to meet every distinct setup and step, and every rank they wait for.

Ranks on one pipeline stage build the same modules; they differ only in which shard of each tensor they hold, and
the first and the last coordinate on every other dim hold the extreme shards (an uneven split leaves the last one
short). Pipeline stages differ in everything. So the check runs every stage at all coordinates 0, and again at all
coordinates last when the Layout says a rank there holds shards of other shapes. A stage waits for objects from the
stages beside it on its own coordinates, so each checked pipeline is whole.
"""

from __future__ import annotations

from lightning_nd.layout.record import Layout
from lightning_nd.mesh.dims import ParallelDims
from lightning_nd.mesh.roles import role_groups


def pipelines_to_check(layout: Layout) -> list[list[int]]:
    """The global ranks of each checked pipeline, stage 0 first: one, or two when shard shapes differ."""
    sizes = {name: layout.dims[name] for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")}
    groups = role_groups(ParallelDims(**sizes, world_size=len(layout.ranks)), "pp")
    first, last = groups[0], groups[-1]
    differ = any(_shapes(layout, a) != _shapes(layout, b) for a, b in zip(first, last))
    return [first, last] if differ else [first]


def _shapes(layout: Layout, rank: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(param.name, param.local_shape) for param in layout.rank(rank).params]
