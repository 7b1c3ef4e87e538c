"""The calibration's 2-D FSDP unit (`framework_benchmarks._two_d_blocks`), built on torch's fake process group as
rank 1 of 4: the parameters FSDP shards are tp's DTensors on a 2-D mesh, as a ``dp_shard x tp`` layout's are, and
its twin without FSDP is the same blocks on the same tp group. The times are measured by a real calibration
(`test_calibrate.py` runs one; its 2 ranks hold no such mesh)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_nd.cost.framework_benchmarks import UNITS, _two_d_blocks


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    yield
    dist.destroy_process_group()


def test_the_two_d_unit_shards_tensor_parallel_parameters_over_a_second_mesh_dimension(fake_world):
    sharded, tp_only, sequence = _two_d_blocks(2, 4)
    assert len(sharded) == len(tp_only) == UNITS // 2
    weights = [sharded[0].up.weight, tp_only[0].up.weight]
    assert all(isinstance(w, DTensor) for w in weights)
    assert sharded[0].up.weight.device_mesh.mesh_dim_names == ("shard", "tp")
    two_d = (_StridedShard(0, split_factor=2), Shard(0))  # FSDP's rows of tp's column-wise rows, as under dp x tp
    assert sharded[0].up.weight.placements == two_d
    assert tp_only[0].up.weight.device_mesh.mesh_dim_names == ("tp",)
    assert sequence.placements == (Shard(1),) and sequence.device_mesh.mesh_dim_names == ("tp",)
    for blocks in (sharded, tp_only):
        blocks(sequence).to_local().sum().backward()
        assert all(p.grad is not None for p in blocks.parameters())
    assert sharded[0].up.weight.grad.placements == two_d
    assert torch.equal(torch.tensor(sequence.to_local().shape), torch.tensor([2, 4, 8]))
