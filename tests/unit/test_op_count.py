"""`count_ops`: the operations of one forward and backward, read from the model's own code on the meta device, by
block; None where the forward cannot run there (a data-dependent MoE dispatch)."""

from __future__ import annotations

import torch
from torch import nn

from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import Llama, LlamaConfig
from lightning_nd.cost.op_count import count_model_ops, count_ops
from lightning_nd.planner.source import Holder
from tests.distributed.meta_starts_ranks import conf_model


class Projections(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 48) if fused else nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
                                    for _ in range(2))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            parts = block(hidden).chunk(3, -1) if isinstance(block, nn.Linear) else [part(hidden) for part in block]
            hidden = sum(parts)
        return hidden


def test_every_block_of_a_model_counts_alike_and_the_rest_apart():
    count = count_model_ops(GPT(GPTConfig(**conf_model("gpt"))))
    assert count is not None and len(count.per_block) == 4 and len(set(count.per_block)) == 1
    assert count.per_block[0] > 50 and count.outside > 0 and count.total == sum(count.per_block) + count.outside


def test_the_count_is_read_from_the_code_a_fused_projection_runs_fewer():
    fused = count_ops(Projections(True), ["blocks.0", "blocks.1"])
    apart = count_ops(Projections(False), ["blocks.0", "blocks.1"])
    assert fused is not None and apart is not None and fused.per_block[0] < apart.per_block[0]


def test_the_model_inside_a_holder_is_counted_and_the_model_is_left_as_it_was():
    model = Llama(LlamaConfig(**conf_model("llama")))
    before = {name: p.clone() for name, p in model.named_parameters()}
    assert count_model_ops(Holder(model)) == count_model_ops(model) is not None
    assert all(torch.equal(p, before[name]) and p.grad is None for name, p in model.named_parameters())


def test_a_data_dependent_dispatch_gives_no_count():
    assert count_model_ops(Llama(LlamaConfig(**conf_model("moe")))) is None
