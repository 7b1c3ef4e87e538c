"""The memory probes (`diagnostics/collect/memory.py`) on CPU: model state counted to the byte from tensors whose
sizes are known, local shards of DTensors (one process, a fake process group), the process from /proc, and the
CUDA probes answering nothing without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from diagnostics.collect import memory
from diagnostics.collect.memory import cuda_memory, model_state_bytes, process_memory, snapshot_if_recording

FLOAT32 = 4


def one_adamw_step(module: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return optimizer


def test_model_state_of_a_linear_after_one_adamw_step():
    model = nn.Linear(4, 3)
    numel = 4 * 3 + 3
    before = model_state_bytes(model, torch.optim.AdamW(model.parameters()))
    assert before == {"params": numel * FLOAT32, "grads": 0, "optimizer": 0, "optimizer_steps": 0}
    optimizer = one_adamw_step(model)
    assert model_state_bytes(model, optimizer) == {
        "params": numel * FLOAT32, "grads": numel * FLOAT32, "optimizer": 2 * numel * FLOAT32,
        "optimizer_steps": 2 * FLOAT32}  # exp_avg and exp_avg_sq; one 0-dim float32 step per parameter
    assert model_state_bytes(model, None)["optimizer"] == 0


def test_a_tied_weight_counts_once():
    embedding = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    model = nn.ModuleDict({"embedding": embedding, "head": head})
    assert model_state_bytes(model, None)["params"] == 10 * 4 * FLOAT32


def test_dtensors_count_their_local_shard():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = nn.Module()
        model.weight = nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
        model.weight.grad = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
        optimizer = torch.optim.AdamW(model.parameters())
        optimizer.step()
        shard = 4 * 4 * FLOAT32
        assert model_state_bytes(model, optimizer) == {
            "params": shard, "grads": shard, "optimizer": 2 * shard, "optimizer_steps": FLOAT32}
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="process_memory reads /proc/self/status (Linux only); the no-/proc path is tested below")
def test_process_memory_reads_rss_and_its_peak():
    values = process_memory()
    assert set(values) == {"rss_bytes", "peak_rss_bytes"}
    assert all(isinstance(v, int) and v > 0 for v in values.values())
    assert values["peak_rss_bytes"] >= values["rss_bytes"]


def test_process_memory_without_proc(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "STATUS", tmp_path / "missing")
    assert process_memory() == {"rss_bytes": None, "peak_rss_bytes": None}


def test_cuda_probes_answer_only_with_cuda(tmp_path):
    values = cuda_memory()
    if not torch.cuda.is_available():
        assert values is None
        assert snapshot_if_recording(tmp_path / "snapshot.pickle") is False
        assert not (tmp_path / "snapshot.pickle").exists()
        return
    assert set(values) == {"allocated", "reserved", "peak_allocated", "peak_reserved", "capacity", "free",
                           "non_pytorch"}
    assert values["capacity"] == values["free"] + values["reserved"] + values["non_pytorch"]
