"""Where a TP plan comes from and what it resolves to, on bare modules (resolution only inspects).

The expected plans are written out by hand from the models' definitions.
"""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from examples.models.gpt import GPT, GPTConfig
from lightning_nd.model.structure import read_model_facts
from lightning_nd.tensor_parallel.infer.declared import pattern_to_regex
from lightning_nd.tensor_parallel.infer.resolve import resolve_tp_plan
from lightning_nd.tensor_parallel.infer.structure import left_whole
from tests.models import build

LLAMA_LAYER_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def _resolve(model: nn.Module, explicit=None, *, tp: int = 2, sequence_parallel: bool = False):
    return resolve_tp_plan(model, explicit, tp=tp, facts=read_model_facts(model), sequence_parallel=sequence_parallel)


def _llama_expected(prefix: str = "", layers: int = 2) -> dict[str, str]:
    expected = {f"{prefix}embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}
    for layer in range(layers):
        expected.update({f"{prefix}layers.{layer}.{name}": style for name, style in LLAMA_LAYER_PLAN.items()})
    return expected


def test_example_llama_resolves_by_name_patterns():
    model = build("llama")
    assert len(model.layers) == 2
    plan = _resolve(model)
    assert plan.entries == _llama_expected()
    assert "name patterns" in plan.source


def test_sequence_parallel_adds_the_residual_norms():
    plan = _resolve(build("llama"), sequence_parallel=True)
    norms = {f"layers.{layer}.{norm}" for layer in range(2) for norm in ("input_norm", "post_attention_norm")}
    assert plan.entries == {**_llama_expected(), **dict.fromkeys([*norms, "norm"], "sequence_parallel")}


def test_gpt_tied_head_stays_out_of_the_plan():
    model = build("gpt")
    assert model.out.weight is model.tok.weight
    plan = _resolve(model)
    assert "out" not in plan.entries
    assert "tok" not in plan.entries
    expected = {}
    for block in range(2):
        expected.update({f"blocks.{block}.attn.{name}": "colwise" for name in ("wq", "wk", "wv")})
        expected.update({f"blocks.{block}.attn.wo": "rowwise", f"blocks.{block}.fc1": "colwise",
                         f"blocks.{block}.fc2": "rowwise"})
    assert plan.entries == expected


def test_gpt_untied_head_is_in_the_plan():
    """The same head, untied, is found: the tie alone keeps it out."""
    model = GPT(GPTConfig(vocab_size=256, n_embd=48, n_head=4, n_layer=2))
    model.out.weight = nn.Parameter(model.out.weight.detach().clone())
    assert _resolve(model).entries["out"] == "colwise_gather_output"


def test_hf_llama_resolves_from_its_declared_plan():
    plan = _resolve(build("hf_llama"))
    assert "_tp_plan" in plan.source
    assert plan.entries["lm_head"] == "colwise_gather_output"
    assert plan.entries["model.embed_tokens"] == "embedding_rowwise"
    assert plan.entries == _llama_expected(prefix="model.")


def test_explicit_plan_wins_over_the_declared_one():
    explicit = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    plan = _resolve(build("hf_llama"), explicit)
    assert "tp_plan=" in plan.source
    assert plan.entries == {
        "model.layers.0.mlp.gate_proj": "colwise",
        "model.layers.1.mlp.gate_proj": "colwise",
        "model.layers.0.mlp.down_proj": "rowwise",
        "model.layers.1.mlp.down_proj": "rowwise",
    }


def test_explicit_plan_wins_over_name_patterns():
    mlp = {"layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    plan = _resolve(build("llama"), mlp)
    assert plan.entries == {f"layers.{layer}.mlp.{name}": style for name, style in
                            (("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise"))
                            for layer in range(2)}


@pytest.mark.parametrize(("explicit", "words"), [
    ({"layers.*.mlp.up_proj": "colwise"}, ["`layers.0.mlp.up_proj` is colwise", "no rowwise layer", "HINT"]),
    ({"layers.*.self_attn.o_proj": "rowwise"}, ["`layers.0.self_attn.o_proj` is rowwise", "no colwise layer"]),
])
def test_a_split_layer_without_its_partner_is_refused(explicit, words):
    with pytest.raises(ValueError) as error:
        _resolve(build("llama"), explicit)
    assert all(word in str(error.value) for word in words), error.value


def test_name_patterns_leave_out_a_layer_without_its_partner():
    """A guessed `value` layer with no rowwise layer next to it is not split (it would change a width)."""
    model = build("llama")
    model.layers[0].probe = nn.ModuleDict({"value": nn.Linear(64, 64)})
    entries = _resolve(model).entries
    assert "layers.0.probe.value" not in entries and entries["layers.0.mlp.down_proj"] == "rowwise"


def test_explicit_plan_of_parallel_style_objects():
    """`tp_plan` values may be torch `ParallelStyle`s, not only style names."""
    colwise, rowwise = ColwiseParallel(), RowwiseParallel()
    plan = _resolve(build("llama"), {"layers.*.mlp.up_proj": colwise, "layers.*.mlp.down_proj": rowwise})
    assert plan.entries == {"layers.0.mlp.up_proj": colwise, "layers.1.mlp.up_proj": colwise,
                            "layers.0.mlp.down_proj": rowwise, "layers.1.mlp.down_proj": rowwise}


@pytest.mark.parametrize(
    ("name", "matches"),
    [
        ("layers.0.q_proj", True),
        ("layers.12.q_proj", True),
        ("layers.0.x.q_proj", False),
        ("layers..q_proj", False),
        ("model.layers.0.q_proj", False),
        ("layers.0.q_proj.weight", False),
        ("layers.0.q_projx", False),
    ],
)
def test_star_matches_exactly_one_name_component(name, matches):
    assert bool(pattern_to_regex("layers.*.q_proj").match(name)) is matches


def test_pattern_dots_are_literal():
    assert not pattern_to_regex("layers.*.q_proj").match("layers.0xq_proj")


class _Heads(nn.Module):
    def __init__(self, heads: int) -> None:
        super().__init__()
        self.n_heads = heads
        self.q_proj, self.o_proj = nn.Linear(24, 24), nn.Linear(24, 24)


class _TwoHeadCounts(nn.Module):
    """Attention modules with different head counts: the second does not divide by 4."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Heads(4), _Heads(6)])


def test_every_module_head_count_is_checked_when_planning():
    from lightning_nd import ParallelConfig, ParallelDims, plan_layout

    with pytest.raises(ValueError, match=r"`layers.1.n_heads=6`: its heads would be split mid-head. HINT: choose tp from \[1, 2, 3, 6\]"):
        plan_layout(_TwoHeadCounts(), ParallelDims(tp=4, world_size=4), ParallelConfig())


def test_gpt2_conv1d_layers_resolve_with_a_three_part_qkv():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16))
    entries = _resolve(model).entries
    assert {name: entries[f"transformer.h.0.{name}"] for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")} \
        == {"attn.c_attn": "packed_qkv", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}
    assert "lm_head" not in entries  # tied to wte


def test_hf_styles_keep_their_hugging_face_meaning():
    """Phi-3's in-block `colwise_gather_output` gathers (ours is the head); Qwen3's per-head norms sum gradients."""
    from transformers import Phi3Config, Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    small = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=64, pad_token_id=0)
    phi3 = _resolve(Phi3ForCausalLM(Phi3Config(**small))).entries
    assert (phi3["model.layers.0.self_attn.qkv_proj"], phi3["model.layers.0.self_attn.o_proj"], phi3["lm_head"]) == \
        ("colwise_rep", "rowwise_split_input", "colwise_gather_output")
    qwen3 = _resolve(Qwen3ForCausalLM(Qwen3Config(**small, head_dim=8))).entries
    assert qwen3["model.layers.0.self_attn.q_norm"] == "replicated_with_grad_allreduce"


def test_a_declared_style_not_applied_here_is_refused_by_name():
    from lightning_nd.tensor_parallel.infer.hugging_face import TPPlanRefusal

    model = build("hf_llama")
    model.model.layers[0].self_attn._tp_plan = {"q_proj": "some_future_style"}
    with pytest.raises(TPPlanRefusal, match=r"`model.layers.0.self_attn.q_proj` \(some_future_style\): it is not a"
                                            r" style of the installed `transformers`.\n  HINT") as refusal:
        _resolve(model)
    assert refusal.value.pieces == {"some_future_style": "model.layers.0.self_attn.q_proj"}


def test_the_torch_transformer_is_planned_by_heads_and_structure():
    """`nn.MultiheadAttention` split by heads as a whole (its out_proj rowwise); the feed-forward pair found from the
    block's structure; a plan naming only a part of the attention is refused with the whole-module entry to use."""
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    plan = _resolve(model)
    assert plan.entries == {f"layers.{i}.{name}": style for i in range(2) for name, style in (
        ("self_attn", "multihead_attention"), ("self_attn.out_proj", "rowwise"), ("linear1", "colwise"),
        ("linear2", "rowwise"))}
    assert {plan.sources[f"layers.0.{name}"] for name in ("linear1", "linear2")} == {"structure"}
    with pytest.raises(ValueError, match=r"`layers.0.self_attn.out_proj`: 'rowwise', part of `layers.0.self_attn`, an"
                                         r" `nn.MultiheadAttention`.*HINT.*'layers.0.self_attn': 'multihead_attention'"):
        _resolve(model, {"layers.*.self_attn.out_proj": "rowwise", "layers.*.linear1": "colwise",
                         "layers.*.linear2": "rowwise"})
    explicit = _resolve(model, {"layers.*.self_attn": "multihead_attention"})
    assert explicit.entries == {f"layers.{i}.self_attn{part}": style for i in range(2)
                                for part, style in (("", "multihead_attention"), (".out_proj", "rowwise"))}
    with pytest.raises(ValueError, match=r"does not divide `num_attention_heads=4` \(read from `layers.0.self_attn`\)"):
        _resolve(model, tp=8)


class _Block(nn.Module):
    """A block with names no pattern knows: BERT's shape (the heads' output layer in the next module) or Bloom's
    (fused head-major [q; k; v] and the output layer in the attention module), and a feed-forward pair."""

    def __init__(self, fused: bool, norm_inner: bool = False) -> None:
        super().__init__()
        self.attn = nn.Module()
        self.attn.num_heads = 4
        if fused:
            self.attn.query_key_value, self.attn.dense = nn.Linear(16, 48), nn.Linear(16, 16)
        else:
            self.attn.alpha, self.attn.beta, self.attn.gamma = (nn.Linear(16, 16) for _ in range(3))
            self.after = nn.Linear(16, 16)
        self.grow, self.shrink = nn.Linear(16, 40), nn.Linear(40, 16)
        if norm_inner:
            self.inner_norm = nn.LayerNorm(40)


def _stack(**kwargs) -> nn.Module:
    return nn.Sequential(*(_Block(**kwargs) for _ in range(2)))


def test_blocks_with_unknown_names_are_planned_from_their_structure():
    bert = _resolve(_stack(fused=False)).entries
    assert {name: style for name, style in bert.items() if name.startswith("0.")} == {
        "0.attn.alpha": "colwise", "0.attn.beta": "colwise", "0.attn.gamma": "colwise", "0.after": "rowwise",
        "0.grow": "colwise", "0.shrink": "rowwise"}
    bloom = _resolve(_stack(fused=True)).entries
    assert {name: style for name, style in bloom.items() if name.startswith("0.")} == {
        "0.attn.query_key_value": "colwise", "0.attn.dense": "rowwise", "0.grow": "colwise", "0.shrink": "rowwise"}
    normed = _resolve(_stack(fused=False, norm_inner=True)).entries  # a norm of the inner width: the MLP stays whole
    assert "0.grow" not in normed and "0.shrink" not in normed and normed["0.after"] == "rowwise"
    with pytest.raises(ValueError, match=r"sequence_parallel=True\)` with a plan inferred from the blocks' structure"
                                         r" \(`0.attn.query_key_value`.*HINT: sequence_parallel=False"):
        _resolve(_stack(fused=True), sequence_parallel=True)


def test_a_fused_projection_of_unknown_order_is_left_whole_and_named():
    model = _stack(fused=True)
    for block in model:
        block.attn.qkv = block.attn.query_key_value  # [q; k; v] part by part or head by head: the name does not say
        del block.attn.query_key_value
    entries = _resolve(model).entries
    assert {name for name in entries if name.startswith("0.")} == {"0.grow", "0.shrink"}
    assert left_whole(model, entries) == ["0.attn.dense.weight", "0.attn.qkv.weight"]  # what the layout warns of


class _L2Norm(nn.Module):
    """Dory's weightless norm: nothing shows its width."""

    def forward(self, x):
        return nn.functional.normalize(x, dim=-1)


@pytest.mark.parametrize("norm", [lambda: nn.RMSNorm(128), _L2Norm], ids=["bitnet_rmsnorm", "dory_l2norm"])
def test_a_norm_over_split_features_leaves_a_guess_whole_and_refuses_a_given_plan(norm):
    """BitNet's and Dory's shapes: a norm over the MLP's inner features, after its colwise layers; each tp rank would
    normalize its own part of them. A weightless norm in the attention (each head's query) leaves it split."""
    model = build("llama")
    for layer in model.layers:
        layer.mlp.sub_norm = norm()
        layer.self_attn.q_norm = _L2Norm()
    guessed = _resolve(model).entries
    assert not any(".mlp." in name for name in guessed) and guessed["layers.0.self_attn.q_proj"] == "colwise"
    explicit = {f"layers.*.{name}": style for name, style in LLAMA_LAYER_PLAN.items()}
    with pytest.raises(ValueError, match=r"`layers.0.mlp.sub_norm` normalizes the features `layers.0.mlp` splits.*"
                                         r"HINT: .*leaves `layers.0.mlp` out"):
        _resolve(model, explicit)


def test_a_per_head_layer_not_split_with_the_heads_is_refused_while_planning():
    """Doge's shape: one value per key/value head (`dt_proj`), rowwise, beside the split q/k/v; its input width (the
    hidden size, which is also q_proj's output width here) does not say whether it reads the module's input or the
    split heads. Without the attention in the plan the same model plans."""
    model = build("llama")
    for layer in model.layers:
        layer.self_attn.dt_proj = nn.Linear(64, 4)  # num_key_value_heads outputs
    explicit = {f"layers.*.{name}": style for name, style in LLAMA_LAYER_PLAN.items()}
    with pytest.raises(ValueError, match=r"`layers.0.self_attn.dt_proj` has one output per head \(`out_features=4` ="
                                         r" `num_key_value_heads`\).* is rowwise.*HINT: pass .*leave"
                                         r" `layers.0.self_attn`"):
        _resolve(model, {**explicit, "layers.*.self_attn.dt_proj": "rowwise"})
    with pytest.raises(ValueError, match=r"`layers.0.self_attn.dt_proj` has one output per head"):
        _resolve(model)  # guessed: still ambiguous
    mlp = {pattern: style for pattern, style in explicit.items() if ".mlp." in pattern}
    assert set(_resolve(model, mlp).entries) == {f"layers.{i}.mlp.{name}" for i in range(2)
                                                 for name in ("gate_proj", "up_proj", "down_proj")}


def test_a_per_head_layer_of_a_guessed_plan_is_split_by_its_outputs():
    """Doge's `dt_proj` reads the values (key/value heads x head_dim = 32 features, split over tp): rowwise, its summed
    outputs cut to the rank's heads. Values at tp=2 are checked on real ranks for Doge by
    tests/distributed/test_hf_families.py; an explicit plan is refused, naming the style to use."""
    style = "per_head_rowwise"
    model = build("llama")
    for layer in model.layers:
        layer.self_attn.dt_proj = nn.Linear(32, 4)
    plan = _resolve(model)
    assert plan.entries["layers.0.self_attn.dt_proj"] == style
    assert plan.sources["layers.0.self_attn.dt_proj"] == "per_head_output"
    explicit = {f"layers.*.{name}": style for name, style in LLAMA_LAYER_PLAN.items()}
    with pytest.raises(ValueError, match=rf"HINT: name `layers.0.self_attn.dt_proj` '{style}' in `NDParallel"):
        _resolve(model, explicit)


class _NormedEmbedding(nn.Embedding):
    """Muse Glimmer's shape: the embedding normalizes the rows it looked up in its own forward."""

    def forward(self, ids):
        return nn.functional.rms_norm(super().forward(ids), (self.embedding_dim,))


def test_an_embedding_whose_forward_works_on_the_rows_stays_whole():
    model = build("llama")
    model.embed_tokens = _NormedEmbedding(256, 64)
    assert _resolve(model).entries == {name: style for name, style in _llama_expected().items()
                                       if name != "embed_tokens"}


def test_a_multi_query_fused_projection_is_left_out_of_a_guess_and_refused_when_named():
    pytest.importorskip("transformers")
    import torch

    from tests.hf_tiny import tiny_model

    with torch.device("meta"):
        model = tiny_model("gpt_bigcode")  # multi-query: c_attn maps 64 features to 64 + 2 x 16
    guessed = _resolve(model).entries
    assert "transformer.h.0.attn.c_attn" not in guessed and "transformer.h.0.attn.c_proj" not in guessed
    assert guessed["transformer.h.0.mlp.c_fc"] == "colwise" and guessed["transformer.h.0.mlp.c_proj"] == "rowwise"
    with pytest.raises(ValueError, match="maps 64 features to 96, not 192"):
        _resolve(model, {"transformer.h.*.attn.c_attn": "packed_qkv", "transformer.h.*.attn.c_proj": "rowwise"})
