"""Where a TP plan comes from and what it resolves to, on bare modules (resolution only inspects).

The expected plans are written out by hand from the models' definitions.
"""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from examples.models.gpt import GPT, GPTConfig
from lightning_nd.layout.tp_plan import pattern_to_regex, resolve_tp_plan
from lightning_nd.layout.structure import read_model_facts
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
    plan = _resolve(build("llama"), {"layers.*.mlp.up_proj": "colwise"})
    assert plan.entries == {"layers.0.mlp.up_proj": "colwise", "layers.1.mlp.up_proj": "colwise"}


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
