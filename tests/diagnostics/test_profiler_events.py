"""The profiled step analysed from the profiler's results in memory is the step analysed from its exported file."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from diagnostics.analysis.trace import read_trace, trace_steps
from diagnostics.collect.profiler_events import in_memory_trace
from lightning_nd.runtime.profiling import comm_label, phase_label


@pytest.fixture
def one_rank_group(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29400 + os.getpid() % 500))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _profiled_step() -> torch.profiler.profile:
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with profiler:
        with phase_label("forward"):
            loss = model(torch.randn(8, 32)).square().mean()
        with phase_label("backward"):
            loss.backward()
            for parameter in model.parameters():
                with comm_label("fsdp", "all_reduce"):
                    dist.all_reduce(parameter.grad)
        with phase_label("optimizer"):
            optimizer.step()
    return profiler


def test_the_step_from_memory_is_the_step_from_the_file(one_rank_group, tmp_path):
    profiler = _profiled_step()
    path = tmp_path / "rank0.json"
    profiler.export_chrome_trace(str(path))
    dims = {"dp_shard": 2}
    from_file, from_memory = trace_steps(read_trace(path), dims), trace_steps(in_memory_trace(profiler), dims)
    assert len(from_file) == len(from_memory) == 1
    file_split, memory_split = from_file[0].split, from_memory[0].split
    assert file_split.keys() == memory_split.keys() and {"forward", "backward", "optimizer"} <= file_split.keys()
    assert file_split["backward"]["comm:fsdp"] > 0
    for region, parts in file_split.items():
        assert parts.keys() == memory_split[region].keys(), region
        for part, seconds in parts.items():  # the file's times are microseconds since 1970 in floats: ~1 ns
            assert memory_split[region][part] == pytest.approx(seconds, abs=1e-6), (region, part)  # per event
    assert from_memory[0].step_s == pytest.approx(from_file[0].step_s, abs=1e-6)


def test_a_profile_without_results_has_no_in_memory_trace():
    assert in_memory_trace(object()) is None
