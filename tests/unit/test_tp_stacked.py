"""Experts stored as one ``[E, out, in]`` weight (JetMoE's ``ParallelExperts``) split over tp
(`lightning_nd.tensor_parallel.infer.stacked_experts`): its MoE MLP as a packed feed-forward pair, its mixture of attention heads by
key/value heads with the shared ``[k; v]`` projection; refused under SP (the router would see a sequence shard).
Values under tp=2 are checked on real ranks by tests/distributed/test_hf_families.py (a mutation without the input's
gradient sum makes JetMoE differ by 0.85)."""

from __future__ import annotations

import pytest
import torch

from lightning_nd.model.structure import read_model_facts
from lightning_nd.tensor_parallel.infer.checks import check_plan, tp_split
from lightning_nd.tensor_parallel.infer.resolve import resolve_tp_plan

transformers = pytest.importorskip("transformers")


def _jetmoe():
    from tests.hf_tiny import tiny_model

    with torch.device("meta"):
        return tiny_model("jetmoe")


def test_jetmoe_experts_and_attention_heads_are_split():
    model = _jetmoe()
    plan = resolve_tp_plan(model, None, tp=2, facts=read_model_facts(model), sequence_parallel=False)
    layer = {name.removeprefix("model.layers.0."): style for name, style in plan.entries.items()
             if name.startswith("model.layers.0.")}
    assert layer == {"mlp.input_linear": "stacked_packed_colwise", "mlp.output_linear": "stacked_rowwise",
                     "self_attention.experts.input_linear": "stacked_colwise",
                     "self_attention.experts.output_linear": "stacked_rowwise",
                     "self_attention.kv_proj": "packed_colwise"}
    mlp = model.model.layers[0].mlp
    assert tp_split(mlp.input_linear, "weight", "stacked_packed_colwise") == (1, 2)
    assert tp_split(mlp.output_linear, "weight", "stacked_rowwise") == (2, 1)
    experts = {name: style for name, style in plan.entries.items() if name.startswith("model.layers.0.mlp.")}
    with pytest.raises(ValueError, match=r"does not divide `model.layers.0.mlp.input_linear.experts' outputs=128`"):
        check_plan(model, experts, 3, read_model_facts(model).__class__())


def test_jetmoe_under_sequence_parallelism_is_refused():
    model = _jetmoe()
    with pytest.raises(ValueError, match=r"experts stored as one weight.*HINT: sequence_parallel=False"):
        resolve_tp_plan(model, None, tp=2, facts=read_model_facts(model), sequence_parallel=True)
