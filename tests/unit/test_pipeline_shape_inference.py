"""The trial forward torch runs to learn a later stage's shapes gets zeros, the same on every tp rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, _utils
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_nd.pipeline_parallel.shape_inference import zero_trial_inputs


@pytest.fixture
def later_stage(monkeypatch):
    """Stage 1 of 2, with torch's uninitialised buffers replaced by NaN so garbage is visible every time."""
    def garbage(meta, device):
        return torch.full(meta.shape, float("nan"), dtype=meta.dtype, device=device)

    monkeypatch.setattr(_utils, "_make_tensor_from_meta", garbage)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield PipelineStage(nn.Linear(4, 4), 1, 2, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def test_metadata_inputs_are_zeros_and_real_inputs_pass_through(later_stage):
    before = later_stage._to_tensor(_utils.extract_tensor_meta(torch.ones(3, 4, requires_grad=True)))
    assert torch.isnan(before).all(), "the fixture's stand-in for uninitialised memory did not take"
    zero_trial_inputs(later_stage)
    trial = later_stage._to_tensor(_utils.extract_tensor_meta(torch.ones(3, 4, requires_grad=True)))
    assert torch.equal(trial, torch.zeros(3, 4)) and trial.requires_grad and trial.is_leaf
    real = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(later_stage._to_tensor(real), real)


def test_dtensor_metadata_inputs_are_zeros(later_stage):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    meta = _utils.extract_tensor_meta(distribute_tensor(torch.ones(3, 4), mesh, [Replicate()]))
    later_stage._mesh_cache.update_from_tensors((distribute_tensor(torch.ones(1), mesh, [Replicate()]),))
    zero_trial_inputs(later_stage)
    trial = later_stage._to_tensor(meta)
    assert isinstance(trial, DTensor) and torch.equal(trial.to_local(), torch.zeros(3, 4))
