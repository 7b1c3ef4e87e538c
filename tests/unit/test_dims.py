"""`ParallelDims`: the -1 fill, rank coordinates, the rank table and the topology warnings.

Coordinates are checked against an independent layout: ``arange(world).reshape(shape)`` (row-major,
innermost dim last) and the position of each rank in it.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from lightning_nd.mesh.dims import DIM_NAMES, MESH_DIMS, ParallelDims


def _grid(dims: ParallelDims) -> np.ndarray:
    return np.arange(dims.world_size).reshape(dims.shape)


def _reference_mesh_coordinates(dims: ParallelDims, rank: int) -> dict[str, int]:
    (position,) = np.argwhere(_grid(dims) == rank)
    return dict(zip(MESH_DIMS, (int(c) for c in position)))


def _reference_ep_coordinate(dims: ParallelDims, rank: int) -> int:
    """Index of ``rank`` in its ep group: same pp, dp_replicate, tp and outer part of dp_shard;
    the group runs over the inner ``ep // cp`` part of dp_shard and all of cp."""
    inner = dims.ep // dims.cp
    grid = _grid(dims).reshape(dims.pp, dims.dp_replicate, dims.dp_shard // inner, inner, dims.cp, dims.tp)
    pp, dp_replicate, outer, _, _, tp = (int(c) for c in np.argwhere(grid == rank)[0])
    group = grid[pp, dp_replicate, outer, :, :, tp].flatten().tolist()
    assert len(group) == dims.ep
    return group.index(rank)


@pytest.mark.parametrize(
    ("sizes", "world_size", "filled"),
    [
        ({}, 8, 8),
        ({"tp": 2}, 8, 4),
        ({"tp": 2, "pp": 2, "cp": 2}, 16, 2),
        ({"dp_replicate": 2, "tp": 4}, 8, 1),
    ],
)
def test_dp_shard_minus_one_fills_the_world(sizes, world_size, filled):
    dims = ParallelDims(**sizes, world_size=world_size)
    assert dims.dp_shard == filled
    assert int(np.prod(dims.shape)) == world_size


@pytest.mark.parametrize(("sizes", "name", "filled"), [
    ({"dp_shard": 1, "tp": -1}, "tp", 8),
    ({"dp_shard": 2, "dp_replicate": -1}, "dp_replicate", 4),
    ({"dp_shard": 1, "tp": 2, "pp": -1}, "pp", 4),
])
def test_any_one_mesh_dim_may_fill_the_world(sizes, name, filled):
    dims = ParallelDims(**sizes, world_size=8)
    assert getattr(dims, name) == filled
    assert int(np.prod(dims.shape)) == 8


def test_coordinates_match_row_major_layout():
    dims = ParallelDims(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2, world_size=8)
    assert dims.shape == (2, 1, 2, 1, 2)
    for rank in range(dims.world_size):
        coords = dims.coordinates(rank)
        assert list(coords) == list(DIM_NAMES)
        assert {name: coords[name] for name in MESH_DIMS} == _reference_mesh_coordinates(dims, rank)
        assert coords["ep"] == 0


def test_neighbouring_ranks_share_everything_but_tp():
    dims = ParallelDims(pp=2, dp_shard=2, tp=2, world_size=8)
    for rank in range(0, dims.world_size, 2):
        first, second = dims.coordinates(rank), dims.coordinates(rank + 1)
        assert (first["tp"], second["tp"]) == (0, 1)
        assert {k: v for k, v in first.items() if k != "tp"} == {k: v for k, v in second.items() if k != "tp"}


def test_ep_borrowing_all_of_dp_shard_and_cp():
    dims = ParallelDims(dp_shard=2, cp=2, tp=2, ep=4, world_size=8)
    for rank in range(dims.world_size):
        coords = dims.coordinates(rank)
        assert coords["ep"] == _reference_ep_coordinate(dims, rank)
        assert coords["ep"] == coords["dp_shard"] * dims.cp + coords["cp"]


@pytest.mark.parametrize(
    "sizes",
    [
        {"dp_shard": 4, "cp": 1, "tp": 2, "ep": 2},
        {"dp_shard": 4, "cp": 2, "tp": 1, "ep": 4},
        {"dp_replicate": 2, "dp_shard": 4, "cp": 1, "tp": 1, "ep": 2},
    ],
)
def test_ep_borrowing_the_inner_part_of_dp_shard(sizes):
    world_size = int(np.prod(list(sizes.values()))) // sizes["ep"]
    dims = ParallelDims(**sizes, world_size=world_size)
    assert [dims.coordinates(rank)["ep"] for rank in range(world_size)] == [
        _reference_ep_coordinate(dims, rank) for rank in range(world_size)
    ]


def test_coordinates_reject_a_rank_outside_the_world():
    dims = ParallelDims(tp=2, world_size=4)
    with pytest.raises(ValueError, match="rank=4"):
        dims.coordinates(4)


def test_rank_table_has_a_header_and_one_row_per_rank():
    dims = ParallelDims(pp=2, dp_shard=2, tp=2, world_size=8)
    header, rule, *rows = dims.rank_table().splitlines()
    assert [cell.strip() for cell in header.strip("|").split("|")] == ["rank", *DIM_NAMES]
    assert set(rule) == {"|", "-"}
    assert len(rows) == dims.world_size
    for rank, row in enumerate(rows):
        cells = [int(cell) for cell in row.strip("|").split("|")]
        assert cells[0] == rank
        assert dict(zip(MESH_DIMS, cells[1:])) == _reference_mesh_coordinates(dims, rank)


def test_check_topology_warns_when_tp_spans_nodes():
    dims = ParallelDims(tp=16, world_size=32)
    with pytest.warns(UserWarning, match=r"`tp=16`.*span 2 nodes") as record:
        messages = dims.check_topology(local_world_size=8)
    assert len(messages) == 1
    assert messages == [str(w.message) for w in record]
    assert "HINT" in messages[0]


def test_check_topology_warns_when_cp_pushes_the_group_across_nodes():
    dims = ParallelDims(tp=4, cp=4, world_size=32)
    with pytest.warns(UserWarning, match=r"`cp=4` makes groups of 16"):
        messages = dims.check_topology(local_world_size=8)
    assert len(messages) == 1


@pytest.mark.parametrize(("sizes", "local_world_size"), [({"tp": 8}, 8), ({"tp": 4, "cp": 2}, 8), ({"tp": 2}, None)])
def test_check_topology_is_silent_when_groups_fit_in_a_node(sizes, local_world_size):
    dims = ParallelDims(**sizes, world_size=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dims.check_topology(local_world_size) == []


@pytest.mark.parametrize(
    ("sizes", "world_size"),
    [({}, 8), ({"tp": 2}, 8), ({"tp": 2, "cp": 2}, 16), ({"dp_replicate": 2, "tp": 2}, 16), ({"pp": 2, "tp": 2}, 16)],
)
def test_batch_size_multiplier_counts_ranks_that_see_different_samples(sizes, world_size):
    dims = ParallelDims(**sizes, world_size=world_size)
    samples_per_rank = {}
    for rank in range(world_size):
        coords = dims.coordinates(rank)
        samples_per_rank.setdefault((coords["dp_replicate"], coords["dp_shard"]), []).append(rank)
    assert dims.batch_size_multiplier == len(samples_per_rank)
    assert dims.batch_size_multiplier == world_size // (dims.pp * dims.cp * dims.tp)
