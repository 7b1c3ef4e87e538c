"""`count_ops`: the operations of one forward and backward, read from the model's own code on the meta device, by
block; on a CPU copy where the forward cannot run there (a data-dependent MoE dispatch) and the model is small."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import Llama, LlamaConfig
from lightning_nd.cost import op_count
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


class Doubling(nn.Module):
    """A linear layer, then ``extra`` multiplications of its [1, tokens, 16] output by 2."""

    def __init__(self, extra: int) -> None:
        super().__init__()
        self.linear, self.extra = nn.Linear(16, 16), extra

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(hidden)
        for _ in range(self.extra):
            hidden = hidden * 2
        return hidden


class Scaled(nn.Module):
    def __init__(self, extra: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(Doubling(extra) for _ in range(2))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return hidden


def test_the_bytes_per_token_are_what_the_memory_bound_operations_read_and_write():
    """One multiplication of 16 float32 channels per token reads and writes 2 x 64 bytes forward, and its gradient
    the same backward: 256 bytes per token more per block, 512 in all, counted exactly (the backward's bytes are
    split between the blocks and the rest as the forward's were, so each block's share is close, not exact); a
    matmul moves none (priced by its FLOPs)."""
    plain, more = count_ops(Scaled(0), ["blocks.0", "blocks.1"]), count_ops(Scaled(1), ["blocks.0", "blocks.1"])
    assert plain is not None and more is not None and plain.outside_bytes_per_token > 0  # the embedding's gather
    total = sum(more.bytes_per_token) + more.outside_bytes_per_token
    assert total - sum(plain.bytes_per_token) - plain.outside_bytes_per_token == pytest.approx(512)
    assert more.bytes_per_token[0] == more.bytes_per_token[1] and all(
        200 < b - a <= 256 for a, b in zip(plain.bytes_per_token, more.bytes_per_token))
    llama = count_model_ops(Llama(LlamaConfig(**conf_model("llama"))))
    assert llama is not None and len(set(llama.bytes_per_token)) == 1 and llama.bytes_per_token[0] > 1000


def test_the_model_inside_a_holder_is_counted_and_the_model_is_left_as_it_was():
    model = Llama(LlamaConfig(**conf_model("llama")))
    before = {name: p.clone() for name, p in model.named_parameters()}
    assert count_model_ops(Holder(model)) == count_model_ops(model) is not None
    assert all(torch.equal(p, before[name]) and p.grad is None for name, p in model.named_parameters())


def test_a_data_dependent_dispatch_is_counted_on_a_cpu_copy_with_every_expert_running(monkeypatch):
    """The MoE's dispatch cannot run on the meta device: its small model is counted on a CPU copy (from a model on
    the meta device too, as the planner has it), the same each time, the model left as it was, the operations inside
    its experts apart and every expert's loop run (twice the experts, about twice those); above `CPU_COUNT_PARAMS`
    parameters, no count."""
    config = conf_model("moe")
    model = Llama(LlamaConfig(**config))
    before = {name: p.clone() for name, p in model.named_parameters()}
    count = count_model_ops(model)
    with torch.device("meta"):
        on_meta, wider = Llama(LlamaConfig(**config)), Llama(LlamaConfig(**{**config, "num_experts": 16}))
    assert count is not None and count == count_model_ops(model) == count_model_ops(on_meta)
    assert len(count.expert_ops) == 2 and 100 < count.expert_ops[0] < count.per_block[0]
    assert count.bytes_per_token[0] > 1000
    more = count_model_ops(wider)
    assert more is not None and 1.8 < more.expert_ops[0] / count.expert_ops[0] < 2.2
    assert all(torch.equal(p, before[name]) and p.grad is None for name, p in model.named_parameters())
    dense = count_model_ops(Llama(LlamaConfig(**conf_model("llama"))))
    assert dense is not None and dense.expert_ops == ()
    monkeypatch.setattr(op_count, "CPU_COUNT_PARAMS", 1000)
    assert count_model_ops(model) is None
