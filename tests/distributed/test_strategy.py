"""What `NDParallel` promises beyond parity, checked on 4 real ranks (see strategy_ranks.py)."""

from __future__ import annotations

import pytest
import torch

from tests.launcher import launch


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return launch("tests.distributed.strategy_ranks:run_all", 4, tmp_path_factory.mktemp("scenarios"), timeout=900)


def result(outcomes, name: str, rank: int = 0):
    outcome = outcomes[rank][name]
    assert "error" not in outcome, outcome.get("error")
    return outcome["result"]


@pytest.mark.parametrize("model_name", ["gpt", "llama"])
def test_meta_init_builds_nothing_whole_and_initialises_every_shard(outcomes, model_name):
    facts = result(outcomes, f"meta_init_{model_name}")
    assert facts["built_on_meta"] and not facts["any_meta_left"]
    # fsdp2 x tp2: big matrices are split 4 ways; only small tp-replicated vectors are held twice.
    assert facts["local_fraction"] < 0.30
    assert facts["distinct_rows"] == facts["rows"], "shards were initialised with the same numbers"
    assert facts["weight_std"] == pytest.approx(facts["weight_expected_std"], rel=0.1)


def test_meta_init_replicas_start_and_stay_identical(outcomes):
    # Biases of rowwise layers (Replicate on tp), norms and the position table (FSDP-sharded over
    # dp, copied over tp): every tp replica must start, and stay, identical.
    facts = result(outcomes, "meta_init_gpt")
    assert {"blocks.0.attn.wo.bias", "blocks.0.ln_1.weight", "pos.weight"} <= set(facts["tp_replicated"])
    for rank in range(4):
        assert result(outcomes, "meta_init_gpt", rank)["tp_replicas_differing"] == []


def test_meta_initialised_model_learns(outcomes):
    losses = result(outcomes, "meta_init_llama")["losses"]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0


def test_sampler_splits_over_batch_ranks_only(outcomes):
    facts = result(outcomes, "batch_ranks")
    per_rank = facts["samples_per_rank"]  # rank = dp_shard * 2 + tp
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3], "tp ranks must see the same batch"
    dp0 = [s for batch in per_rank[0] for s in _samples(batch)]
    dp1 = [s for batch in per_rank[2] for s in _samples(batch)]
    assert not set(dp0) & set(dp1)
    assert sorted(dp0 + dp1) == sorted(tuple(s) for s in facts["dataset"])


def _samples(flat: list[int]) -> list[tuple[int, ...]]:
    return [tuple(flat[i:i + 4]) for i in range(0, len(flat), 4)]


def test_metrics_and_logs_count_a_sample_once_under_tp(outcomes):
    facts = result(outcomes, "batch_ranks")
    assert facts["train_samples"] == 20  # 40 if the tp replicas were counted too
    assert facts["ranks_in_sync"] == 2  # self.log(sync_dist=True) reduces over the 2 batch ranks, not all 4


def test_boolean_decisions_count_every_rank(outcomes):
    """`reduce` averages over batch ranks only; decisions (ModelCheckpoint, EarlyStopping) need all ranks."""
    for rank in range(4):
        assert result(outcomes, "batch_ranks", rank)["decisions"] == [True, False, True]


@pytest.mark.parametrize("stage, reduce_grads, gathered", [
    (1, [False, True, False, True], [True, True, True, True]),
    (2, [True, True, True, True], [True, True, True, True]),
    (3, [True, True, True, True], [False, False, False, False]),
])
def test_zero_stage_semantics(outcomes, stage, reduce_grads, gathered):
    facts = result(outcomes, f"zero{stage}")
    assert facts["reduce_grads"] == reduce_grads
    assert facts["gathered_after_forward"] == gathered


def test_bf16_mixed_keeps_fp32_weights_and_gathers_bf16(outcomes):
    facts = result(outcomes, "bf16_mixed")
    assert facts["param_dtypes"] == ["torch.float32"]
    assert facts["fsdp_param_dtype"] == "torch.bfloat16"
    assert all(torch.isfinite(torch.tensor(facts["losses"])))
    assert facts["losses"][-1] < facts["losses"][0]


def test_bf16_true_trains_in_bf16(outcomes):
    facts = result(outcomes, "bf16_true")
    assert facts["param_dtypes"] == ["torch.bfloat16"]
    assert facts["losses"][-1] < facts["losses"][0]


def test_own_configure_model_is_left_alone_and_still_matches(outcomes):
    facts = result(outcomes, "own_configure_model")
    assert not facts["composer_ran"]
    reference = facts["reference"]
    torch.testing.assert_close(torch.tensor(facts["losses"]), torch.tensor(reference["losses"]), rtol=1e-6, atol=2e-6)
    for name, expected in reference["params"].items():
        torch.testing.assert_close(facts["params"][name], expected, rtol=1e-4, atol=5e-5)


def test_indivisible_sequence_raises_with_hint(outcomes):
    message = result(outcomes, "indivisible_sequence")
    assert "sequence length 15" in message and "HINT" in message


def test_gradients_have_their_parameters_layout_before_the_step(outcomes):
    """Without FSDP, torch leaves a vocab-sharded embedding a full replicated gradient and SP norms a
    Partial one; both are aligned after backward (memory share and clipping depend on it)."""
    assert result(outcomes, "grad_layouts_tp4_sp") == []
