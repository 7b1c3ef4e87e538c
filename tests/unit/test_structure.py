"""Model inspection: the repeated blocks and the head counts, compared with the models' own definitions."""

from __future__ import annotations

import pytest
from torch import nn

from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import Attention, DecoderLayer, Llama, LlamaConfig
from lightning_nd.model.structure import find_blocks, read_model_facts
from tests.models import build


def _assert_blocks(found: list[tuple[str, nn.Module]], prefix: str, container: nn.Module) -> None:
    assert [name for name, _ in found] == [f"{prefix}.{index}" for index in range(len(container))]
    assert all(module is block for (_, module), block in zip(found, container))


def test_finds_llama_layers():
    model = build("llama")
    _assert_blocks(find_blocks(model), "layers", model.layers)


def test_finds_gpt_blocks_in_a_sequential():
    model = GPT(GPTConfig(n_layer=3))
    _assert_blocks(find_blocks(model), "blocks", model.blocks)


def test_finds_hf_llama_layers():
    model = build("hf_llama")
    _assert_blocks(find_blocks(model), "model.layers", model.model.layers)


def test_prefers_the_container_holding_the_most_parameters():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
            self.big = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    model = Model()
    _assert_blocks(find_blocks(model), "big", model.big)


def test_no_class_repeated_in_a_container_means_no_blocks():
    assert find_blocks(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8))) == []


@pytest.mark.parametrize("block_class", [DecoderLayer, "DecoderLayer"])
def test_block_classes_by_class_or_name(block_class):
    model = build("llama")
    _assert_blocks(find_blocks(model, [block_class]), "layers", model.layers)


def test_block_classes_keep_outermost_matches_only():
    model = build("llama")
    _assert_blocks(find_blocks(model, ["Attention", DecoderLayer]), "layers", model.layers)


def test_block_classes_can_name_inner_modules():
    model = build("llama")
    found = find_blocks(model, [Attention])
    assert [name for name, _ in found] == ["layers.0.self_attn", "layers.1.self_attn"]
    assert [module for _, module in found] == [layer.self_attn for layer in model.layers]


def test_block_classes_not_in_the_model_find_nothing():
    assert find_blocks(build("llama"), ["TransformerBlock"]) == []


def test_reads_llama_facts_from_its_config_dataclass():
    config = LlamaConfig(hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=12, num_key_value_heads=6)
    facts = read_model_facts(Llama(config))
    assert (facts.num_attention_heads, facts.num_key_value_heads) == (12, 6)
    assert (facts.hidden_size, facts.intermediate_size, facts.num_hidden_layers) == (96, 160, 3)
    assert facts.num_experts is None
    assert facts.sources["num_attention_heads"] == facts.sources["num_key_value_heads"] == "`model.config`"


def test_reads_gpt_heads_from_its_attention_modules():
    model = GPT(GPTConfig(n_embd=48, n_head=6, n_layer=3))
    facts = read_model_facts(model)
    assert facts.num_attention_heads == 6
    assert facts.sources["num_attention_heads"] == "`blocks.0.attn`"
    assert facts.num_key_value_heads is None
    assert facts.num_hidden_layers == 3
    assert facts.sources["num_hidden_layers"] == "the repeated blocks"


def test_reads_hf_llama_facts_from_its_config():
    model = build("hf_llama")
    facts = read_model_facts(model)
    assert facts.num_attention_heads == model.config.num_attention_heads
    assert facts.num_key_value_heads == model.config.num_key_value_heads
    assert facts.num_hidden_layers == model.config.num_hidden_layers
