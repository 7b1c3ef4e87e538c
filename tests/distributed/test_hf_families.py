"""Every causal-LM family of the installed `transformers` (and every family declaring a tp plan) at tp=2 on 2 real
ranks matches the same model in one process, or is on an explicit list with its reason.

One launch (`hf_families_ranks.py`) runs them all: a tiny random config, `plan_layout` at tp=2, the plan applied
on a gloo tp mesh, one forward and backward in float64; logits and every gradient against the whole model. Outcomes:
``planned`` (matches), ``refused`` (the planner refuses, naming why), ``not runnable`` (the tiny model does not run in
one process: vision or audio inputs, config checks), ``differs`` (runs under tp, wrong values) and ``failed`` (the tp
run raises). A family off the list must be ``planned`` or ``not runnable``; one on the list must keep its listed
outcome, so a fix (or a new breakage) updates the list.
"""

from __future__ import annotations

import pytest

from tests.distributed.family_rules import RULES
from tests.launcher import launch

transformers = pytest.importorskip("transformers")
from transformers.models.auto import modeling_auto  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402


def families() -> list[str]:
    causal = set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    declaring = {name for name in CONFIG_MAPPING.keys() if getattr(CONFIG_MAPPING[name], "base_model_tp_plan", None)}
    return sorted(name for name in causal | declaring if name in CONFIG_MAPPING)


FAMILIES = families()
SEQUENCE_PARALLEL = ("llama", "qwen3", "deepseek_v3", "minicpm3", "granite_swa", "doge", "dory", "gpt_bigcode",
                     "neomme", "mamba", "rwkv")
"""Also run with sequence parallelism (keyed ``name+sp``): dense, per-head norms, MLA with and without a q latent,
attention sinks, parameters of a block's own on the residual (Doge), attention or MLP modules left whole (Dory,
GPT-BigCode's multi-query attention), a split module inside a split module fed per-feature tensors (NeoMME), a
state-space mixer split by channels (Mamba), RWKV's mixers taking a plain input."""

NOT_PLANNED: dict[str, tuple[str, str]] = {
    "big_bird": ("refused", "transformers' block-sparse attention replaces its attention module in forward for"
                            " sequences shorter than its blocks; refused naming `set_attention_type('original_full')`,"
                            " with which it plans (tests/unit/test_tp_forward_source.py)"),
}
"""family -> (outcome, reason): what does not train under tp=2 today, and why."""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return launch("tests.distributed.hf_families_ranks:run", 2, tmp_path_factory.mktemp("families"), timeout=900,
                  families=FAMILIES, sequence_parallel=SEQUENCE_PARALLEL)[0]


@pytest.mark.parametrize("model_type", FAMILIES + [f"{name}+sp" for name in SEQUENCE_PARALLEL])
def test_family_trains_under_tp2_as_in_one_process(outcomes, model_type, record_property):
    outcome, detail, error = outcomes[model_type]
    record_property("outcome", f"{outcome} {error:.1e}: {detail}")
    if model_type in NOT_PLANNED:
        assert outcome == NOT_PLANNED[model_type][0], f"{model_type}: now {outcome} ({detail}, {error:.1e}): update NOT_PLANNED"
    else:
        assert outcome in ("planned", "not runnable"), f"{model_type}: {outcome} {error:.1e}: {detail}"


def test_the_enumeration_found_the_families_and_most_plan(outcomes):
    planned = sum(outcome == "planned" for outcome, _, _ in outcomes.values())
    assert len(FAMILIES) > 200 and planned > 100, (len(FAMILIES), planned)


def test_each_rule_is_what_its_families_plan_with(outcomes):
    """`family_rules.py`: every family listed for a style plans at tp=2 with that style (``planned: styles``)."""
    for style, (_, _, families) in RULES.items():
        for family in families:
            outcome, detail, _ = outcomes[family]
            assert outcome == "planned" and style in detail.split("styles: ", 1)[-1].split(", "), (style, family, detail)
