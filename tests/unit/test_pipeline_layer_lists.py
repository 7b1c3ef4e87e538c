"""A pipeline stage's copy of a Hugging Face config lists its own layers' types only: the model's forward picks each
block's mask by the block's position among those it holds (gpt-oss trained with the wrong masks on stage 1 before;
its parity under pp is in tests/distributed/test_families.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_nd.pipeline_parallel.layer_lists import restrict_layer_lists

transformers = pytest.importorskip("transformers")


def test_a_later_stage_reads_its_own_layers_types():
    config = transformers.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                       layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                    "full_attention"])
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(config)
    blocks = [f"model.layers.{index}" for index in range(4)]
    stage = copy.deepcopy(model)
    restrict_layer_lists(stage, blocks, {"model.layers.1", "model.layers.2"})
    assert stage.config.layer_types == ["full_attention", "sliding_attention"]
    assert stage.model.config is stage.config and model.config.layer_types == config.layer_types
    whole = copy.deepcopy(model)
    restrict_layer_lists(whole, blocks, set(blocks))
    assert whole.config.layer_types == config.layer_types
