"""Which ``_StridedShard`` tensors a checkpoint swaps (`lightning_nd.checkpoint.strided.packed`): exactly those where
some rank's shard is not the block DCP describes it by (torch's own offset and size), checked on every rank of a
fake process group against the tensor torch distributes. FSDP over a tp-split dim is left as it is: swapping it cost
two sequential all_gathers per tensor at every save, and DTensor warned so on every rank."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_nd.checkpoint.strided import packed

CASES = {  # name: (mesh shape, placements, whole tensor's shape, packed)
    "fsdp x tp colwise": ((2, 2), (_StridedShard(0, split_factor=2), Shard(0)), (8, 4), False),
    "fsdp x tp, uneven rows": ((2, 2), (_StridedShard(0, split_factor=2), Shard(0)), (7, 4), False),
    "hsdp x tp": ((2, 2, 2), (Replicate(), _StridedShard(0, split_factor=2), Shard(0)), (8, 4), False),
    "fsdp x tp=4": ((2, 4), (_StridedShard(0, split_factor=4), Shard(0)), (16, 4), False),
    "fused [gate; up] over tp": ((2,), (_StridedShard(0, split_factor=2),), (8, 4), True),
    "fused [q; k; v] over tp, fsdp on dim 1": ((2, 2), (Shard(1), _StridedShard(0, split_factor=3)), (12, 4), True),
    "experts' gate_up_proj over ep x tp": ((2, 2), (Shard(0), _StridedShard(1, split_factor=2)), (2, 8, 4), True),
    "fsdp x fused over tp": ((2, 2), (_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2)), (16, 4),
                             True),
    "plain shards": ((2, 2), (Shard(0), Shard(1)), (8, 4), False),
}


def where_dcp_puts_it(rank: int, mesh_shape: tuple[int, ...], placements, shape) -> tuple[bool, bool]:
    """On ``rank``: whether its shard is the block at DCP's offset and size, and `packed` there."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=math.prod(mesh_shape))
    try:
        mesh = init_device_mesh("cpu", mesh_shape)
        whole = torch.arange(torch.Size(shape).numel()).view(shape)
        tensor = distribute_tensor(whole, mesh, placements, src_data_rank=None)
        size, offset = compute_local_shape_and_global_offset(whole.shape, mesh, placements)
        block = whole[tuple(slice(start, start + length) for start, length in zip(offset, size))]
        return torch.equal(tensor.to_local(), block), packed(tensor)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", CASES)
def test_only_a_shard_that_is_not_one_block_is_swapped(name):
    mesh_shape, placements, shape, expected = CASES[name]
    ranks = [where_dcp_puts_it(rank, mesh_shape, placements, shape) for rank in range(math.prod(mesh_shape))]
    assert all(is_packed == expected for _, is_packed in ranks), ranks  # the same answer on every rank
    assert (not all(in_place for in_place, _ in ranks)) == expected, ranks
