"""What a module's forward shows that its parameters do not (`lightning_nd.tensor_parallel.infer.forward_source`): TrOCR's attention
reshapes with its input's width, so a guessed head split leaves it whole (its MLP split); BigBird's block-sparse
attention replaces its attention module in forward, so its plan is refused naming the mode that plans. Values under
tp=2 for TrOCR are checked on real ranks by tests/distributed/test_hf_families.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_nd.model.structure import read_model_facts
from lightning_nd.tensor_parallel.infer.forward_source import reshapes_with_input_width
from lightning_nd.tensor_parallel.infer.resolve import resolve_tp_plan

transformers = pytest.importorskip("transformers")


def _tiny(model_type: str) -> nn.Module:
    from tests.hf_tiny import tiny_model

    with torch.device("meta"):
        return tiny_model(model_type)


def _plan(model: nn.Module, explicit=None):
    return resolve_tp_plan(model, explicit, tp=2, facts=read_model_facts(model), sequence_parallel=False)


def test_an_attention_reshaping_with_its_input_width_is_left_whole_or_refused_when_named():
    model = _tiny("trocr")
    attention = model.model.decoder.layers[0].self_attn
    assert reshapes_with_input_width(attention) == "bsz, tgt_len, embed_dim = hidden_states.size()"
    entries = _plan(model).entries
    assert not any(".self_attn." in name or ".encoder_attn." in name for name in entries)
    assert entries["model.decoder.layers.0.fc1"] == "colwise" and entries["model.decoder.layers.0.fc2"] == "rowwise"
    explicit = {f"model.decoder.layers.*.self_attn.{name}": style for name, style in (
        ("q_proj", "colwise"), ("k_proj", "colwise"), ("v_proj", "colwise"), ("out_proj", "rowwise"))}
    with pytest.raises(ValueError, match=r"takes its width from its input \(`bsz, tgt_len, embed_dim = hidden_states"
                                         r".size\(\)`\).*HINT: .*leaves `model.decoder.layers.0.self_attn` out"):
        _plan(model, explicit)


def test_a_module_whose_input_is_reshaped_by_itself_is_not_flagged():
    class Experts(nn.Module):
        def forward(self, hidden_states):
            batch, length, width = hidden_states.shape
            return hidden_states.view(-1, width).view(batch, length, -1)

    assert reshapes_with_input_width(Experts()) is None


def test_block_sparse_bigbird_is_refused_naming_the_full_attention_mode():
    model = _tiny("big_bird")
    with pytest.raises(ValueError, match=r"`bert.encoder.layer.1.attention` replaces its attention module.*HINT: call"
                                         r" `set_attention_type\('original_full'\)`"):
        _plan(model)
    model.bert.set_attention_type("original_full")
    assert _plan(model).entries["bert.encoder.layer.0.attention.self.query"] == "colwise"
