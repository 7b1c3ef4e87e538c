"""Recurrent mixers split by channels under tp (`lightning_nd.tensor_parallel.infer.ssm`): Mamba's, Falcon-Mamba's and RWKV's
mixers are recognised by their shapes, Mamba-2's (one projection of unequal parts) are not, and a mixer with a layer
of another shape stays whole. Values under tp are checked on real ranks for Mamba, Falcon-Mamba, RWKV (Mamba and
RWKV also with SP) and Jamba by tests/distributed/test_hf_families.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_nd.model.structure import read_model_facts
from lightning_nd.tensor_parallel.infer.checks import tp_split
from lightning_nd.tensor_parallel.infer.resolve import resolve_tp_plan
from lightning_nd.tensor_parallel.infer.ssm import selective_scan_plan

transformers = pytest.importorskip("transformers")

MIXER = {"": "channel_mixer", "conv1d": "channel_params", "in_proj": "packed_colwise",
         "x_proj": "rowwise_shared_output", "dt_proj": "channel_params", "out_proj": "rowwise"}


def _mamba(model_type: str) -> nn.Module:
    from tests.hf_tiny import tiny_model

    with torch.device("meta"):
        return tiny_model(model_type)


@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba"])
def test_a_mamba_mixer_is_split_by_channels(model_type):
    model = _mamba(model_type)
    plan = resolve_tp_plan(model, None, tp=2, facts=read_model_facts(model), sequence_parallel=True)
    prefix = "backbone.layers.0.mixer"
    mixer = {name.removeprefix(prefix).lstrip("."): style for name, style in plan.entries.items()
             if name == prefix or name.startswith(prefix + ".")}
    assert mixer == MIXER
    owner = model.get_submodule(prefix)
    assert tp_split(owner, "A_log", "channel_mixer") == (0, 1) and tp_split(owner.conv1d, "weight", "channel_params")


def test_rwkv_time_and_channel_mixing_are_split_by_channels():
    model = _mamba("rwkv")
    plan = resolve_tp_plan(model, None, tp=2, facts=read_model_facts(model), sequence_parallel=False)
    block = {name.removeprefix("rwkv.blocks.0."): style for name, style in plan.entries.items()
             if name.startswith("rwkv.blocks.0.")}
    assert block == {"attention": "per_channel_vectors", "attention.key": "colwise", "attention.value": "colwise",
                     "attention.receptance": "colwise", "attention.output": "rowwise", "feed_forward.key": "colwise",
                     "feed_forward.value": "rowwise"}
    attention = model.rwkv.blocks[0].attention
    assert tp_split(attention, "time_decay", "per_channel_vectors") == (0, 1)
    assert tp_split(attention, "time_mix_key", "per_channel_vectors") is None  # [1, 1, H], mixing the input: whole


def test_mamba2_and_a_mixer_of_another_shape_stay_whole():
    config = transformers.Mamba2Config(vocab_size=128, hidden_size=64, expand=2, num_heads=8, head_dim=16, state_size=8,
                                       n_groups=1, num_hidden_layers=1)
    with torch.device("meta"):
        assert selective_scan_plan(transformers.Mamba2ForCausalLM(config), {}) == {}
    model = _mamba("mamba")
    for layer in model.backbone.layers:
        layer.mixer.extra = nn.Linear(64, 64)
    assert selective_scan_plan(model, {}) == {}
