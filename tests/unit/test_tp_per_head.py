"""Per-head state under tp. Multi-head latent attention (DeepSeek-V2/V3): the low-rank down projections and their
norms stay whole on every rank with whole gradients, the shared rotary key's gradient is summed, the per-head up
projections and the output are split. Per-head norms after a colwise layer still have their gradients summed;
attention sinks are split with their heads. Values under tp are checked on real ranks for every such family by
tests/distributed/test_hf_families.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_nd.model.structure import read_model_facts
from lightning_nd.tensor_parallel.infer.checks import tp_split
from lightning_nd.tensor_parallel.infer.hugging_face import TPPlanRefusal
from lightning_nd.tensor_parallel.infer.mla import rope_dim
from lightning_nd.tensor_parallel.infer.resolve import resolve_tp_plan

transformers = pytest.importorskip("transformers")

MLA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
           first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=16)


def _plan(model: nn.Module, tp: int = 2):
    return resolve_tp_plan(model, None, tp=tp, facts=read_model_facts(model), sequence_parallel=False)


def _attention(plan, layer: int = 0) -> dict[str, object]:
    prefix = f"model.layers.{layer}.self_attn."
    return {name.removeprefix(prefix): style for name, style in plan.entries.items() if name.startswith(prefix)}


@pytest.mark.parametrize("q_lora_rank", [48, None])
def test_mla_splits_the_heads_and_keeps_the_latent_whole(q_lora_rank):
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**MLA, q_lora_rank=q_lora_rank))
    plan = _plan(model)
    query = {"q_a_proj": "down_projection", "q_b_proj": "colwise"} if q_lora_rank else {"q_proj": "colwise"}
    assert _attention(plan) == {**query, "kv_a_proj_with_mqa": "mla_kv_a_proj", "kv_b_proj": "colwise",
                                "o_proj": "rowwise"}
    assert rope_dim(model, "model.layers.0.self_attn.kv_a_proj_with_mqa") == 8
    if q_lora_rank:
        assert plan.sources["model.layers.0.self_attn.q_a_proj"] == "down_projection"


def test_per_head_norms_after_a_colwise_layer_still_sum_their_gradients():
    config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(config)
    model.config.base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
                                       "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
    attention = _attention(_plan(model))
    assert attention["q_norm"] == attention["k_norm"] == "replicated_with_grad_allreduce"


class _Latent(nn.Module):
    """An MLA-like attention whose module and config do not say how wide the rotary key is."""

    def __init__(self) -> None:
        super().__init__()
        self.kv_a = nn.Linear(16, 12)
        self.kv_b = nn.Linear(8, 16)
        self.o = nn.Linear(16, 16)
        self.num_heads = 2


class _Model(nn.Module):
    _tp_plan = {"layers.*.attn.kv_a": "mla_kv_a_proj", "layers.*.attn.kv_b": "colwise", "layers.*.attn.o": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"attn": _Latent()})])


def test_mla_without_a_rotary_width_is_refused_naming_the_attribute():
    with pytest.raises(TPPlanRefusal, match="qk_rope_head_dim"):
        _plan(_Model())


def test_attention_sinks_are_split_with_their_heads():
    config = transformers.GraniteSWAConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.GraniteSWAForCausalLM(config)
    attention = _attention(_plan(model))
    assert attention["q_proj"] == "colwise" and "sinks" not in attention
    assert _plan(model).entries["model.layers.0.self_attn"] == "per_head_params"
    assert tp_split(model.model.layers[0].self_attn, "sinks", "per_head_params") == (0, 1)  # bytes per rank: a half


def test_deepseek_v3_at_tp2_holds_half_of_its_parameters_per_rank():
    """MLA split by heads and routed experts split over tp (ETP): only the latents' down projections, norms and
    routers stay whole, so a rank holds about half the model (0.501 for the 6-layer real-width model of the note)."""
    from lightning_nd.planner.dry_run import dry_run
    from lightning_nd.planner.source import Holder

    config = transformers.DeepseekV3Config(**{**MLA, "hidden_size": 256, "intermediate_size": 512,
                                              "moe_intermediate_size": 128, "num_hidden_layers": 4,
                                              "first_k_dense_replace": 1, "n_routed_experts": 8,
                                              "n_shared_experts": 1}, q_lora_rank=64)
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(config)
    whole = sum(param.numel() * param.element_size() for param in model.parameters())
    layout = dry_run(Holder(model), 2, {"tp": 2}, {})
    assert layout.applies("expert_tensor_parallel")
    assert layout.rank(0).param_bytes <= 0.55 * whole, layout.rank(0).param_bytes / whole
