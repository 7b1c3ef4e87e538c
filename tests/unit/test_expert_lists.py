"""Experts kept in a list (lightning_nd/model/expert_lists.py): found by structure, planned under ep (each rank holds
E/ep of them whole, under their own names), refused where ep does not divide them. The dispatch itself runs in
tests/distributed/test_expert_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_nd import ParallelConfig, ParallelDims, plan_layout
from lightning_nd.model.expert_lists import ExpertList, expert_lists


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, inner), nn.Linear(inner, hidden)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(rows)))


class Router(nn.Module):
    """A router of its own weight [E, H] (as DeepSeek's ``MoEGate``), no children."""

    def __init__(self, experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden))


class Block(nn.Module):
    def __init__(self, experts: int = 4, hidden: int = 8, router: bool = False, inner: list[int] | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.gate = Router(experts, hidden) if router else nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(MLP(hidden, width) for width in inner or [16] * experts)


class Model(nn.Module):
    def __init__(self, **block) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.layers = nn.ModuleList(Block(**block) for _ in range(2))
        self.head = nn.Linear(8, 2)  # as many outputs as blocks: the blocks are still no experts


def test_a_list_of_identical_mlps_beside_its_gate_is_found_by_structure():
    for router in (False, True):
        assert expert_lists(Model(router=router)) == [
            ExpertList(f"layers.{i}.experts", f"layers.{i}", f"layers.{i}.gate", 4, 8) for i in range(2)]


@pytest.mark.parametrize("block", [{"inner": [16, 16, 16, 24]}, {"experts": 1}])
def test_unlike_experts_or_one_expert_are_no_list(block):
    assert expert_lists(Model(**block)) == []


def test_a_gate_scoring_another_count_is_no_gate():
    model = Model()
    model.layers[0].gate = nn.Linear(8, 3)
    assert [found.name for found in expert_lists(model)] == ["layers.1.experts"]


def test_ep_holds_each_expert_whole_on_one_rank_of_its_group():
    layout = plan_layout(Model(), ParallelDims(dp_shard=4, ep=2, world_size=4), ParallelConfig())
    assert [(e.module, e.num_experts, e.local_experts, e.sharded_over) for e in layout.experts] == [
        (f"layers.{i}.experts", 4, 2, "expert_dp") for i in range(2)]
    whole = sum(p.numel() for p in Model().layers[0].experts.parameters()) * 2
    for holding in layout.ranks:
        held = [shard for shard in holding.params if shard.kind == "experts"]
        ep = holding.coordinates["ep"]
        assert {shard.name.split(".")[3] for shard in held} == {str(2 * ep), str(2 * ep + 1)}
        assert sum(shard.bytes for shard in held) // 4 == whole // 2 // 2  # E/ep experts, FSDP halves over expert_dp


def test_an_ep_that_does_not_divide_the_list_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"does not divide an experts module's 4 experts. HINT: choose ep from"):
        plan_layout(Model(), ParallelDims(dp_shard=3, ep=3, world_size=3), ParallelConfig())
