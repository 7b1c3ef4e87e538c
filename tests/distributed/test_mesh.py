"""The named sub-meshes hold exactly the ranks that `ParallelDims.coordinates` says, and that the mesh roles
of `mesh/roles.py` compute without a process group (8 gloo ranks)."""

from __future__ import annotations

import pytest

from lightning_nd.mesh.dims import ParallelDims
from lightning_nd.mesh.roles import group_of, role_names
from tests.launcher import launch

WORLD = 8
LAYOUTS = [
    {"dp_shard": 2, "cp": 2, "tp": 2, "ep": 4},
    {"pp": 2, "dp_shard": 2, "tp": 2},
    {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "ep": 2},
]
# Which coordinates vary inside each named group; every other coordinate is shared.
VARYING = {
    "pp": {"pp"}, "dp_replicate": {"dp_replicate"}, "dp_shard": {"dp_shard"}, "cp": {"cp"}, "tp": {"tp"},
    "batch": {"dp_replicate", "dp_shard"}, "fsdp": {"dp_shard", "cp"},
    "loss": {"dp_replicate", "dp_shard", "cp"}, "hsdp": {"dp_replicate", "dp_shard", "cp"},
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return launch("tests.distributed.mesh_ranks:group_ranks", WORLD, tmp_path_factory.mktemp("mesh"),
                  timeout=300, layouts=LAYOUTS)


def expected_group(dims: ParallelDims, rank: int, varying: set[str]) -> list[int]:
    mine = dims.coordinates(rank)
    fixed = [name for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if name not in varying]
    return [other for other in range(dims.world_size)
            if all(dims.coordinates(other)[name] == mine[name] for name in fixed)]


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_named_groups_match_coordinates(reports, index):
    dims = ParallelDims(**LAYOUTS[index], world_size=WORLD)
    for rank in range(WORLD):
        report = reports[rank][index]
        for name, varying in VARYING.items():
            assert sorted(report[name]) == expected_group(dims, rank, varying), (rank, name)
            # the group's ranks in mesh order: this rank's position in it is its local rank
            assert report[name][report["local_rank"][name]] == rank, (rank, name)
        if dims.ep > 1:
            # ep: ranks sharing everything but (the inner part of dp_shard, cp), ep of them, with ep coordinates 0..ep-1
            group = report["ep"]
            assert len(group) == dims.ep and rank in group
            assert sorted(dims.coordinates(r)["ep"] for r in group) == list(range(dims.ep))
            assert all(dims.coordinates(r)["tp"] == dims.coordinates(rank)["tp"] for r in group)
            assert set(group) <= set(report["fsdp"])
        for role in role_names(dims):  # the pure role arithmetic names the same groups, in the same order
            assert report[role] == group_of(dims, role, rank), (rank, role)
