"""Run on each of 2 ranks: a weight packed part by part over tp (``_StridedShard``) through a sharded checkpoint
(tests/distributed/test_strided_checkpoint.py)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from lightning_nd.checkpoint import read_sharded
from lightning_nd.checkpoint.checked_reader import read_index
from lightning_nd.checkpoint.sharded import _load, save_sharded

WHOLE = torch.arange(3 * 8 * 2, dtype=torch.float32).view(3, 8, 2)  # [experts, gate; up, hidden]


def _packed(values: torch.Tensor, mesh):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    rank, half = dist.get_rank(), values.shape[1] // 2
    width = half // dist.get_world_size()
    local = torch.cat([values[:, rank * width:(rank + 1) * width], values[:, half + rank * width:half + (rank + 1) * width]], 1)
    return DTensor.from_local(local.clone(), mesh, [_StridedShard(1, split_factor=2)], run_check=False)


def round_trip(folder: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    packed = _packed(WHOLE, mesh)
    state = {"model": {"experts.gate_up_proj": packed}}
    path = Path(folder) / "ckpt"
    save_sharded(path, state, meta={}, rng={}, info={})
    kept = state["model"]["experts.gate_up_proj"] is packed  # the swap for the save is undone
    dist.barrier()
    written = read_sharded(path)["state_dict"]["experts.gate_up_proj"] if dist.get_rank() == 0 else None
    target = {"model": {"experts.gate_up_proj": _packed(torch.zeros_like(WHOLE), mesh)}}
    own = target["model"]["experts.gate_up_proj"]
    _load(path, read_index(path), target)
    result = {"kept": kept, "loaded_in_place": target["model"]["experts.gate_up_proj"] is own,
              "local_equal": torch.equal(own.to_local(), packed.to_local()), "whole_equal": torch.equal(own.full_tensor(), WHOLE),
              "written_equal": None if written is None else torch.equal(written, WHOLE)}
    dist.destroy_process_group()
    return result
