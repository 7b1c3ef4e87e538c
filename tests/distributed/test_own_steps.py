"""Under pp the module's own steps drive the pipeline: loss, gradients, parameters and every logged value
(mean, sum and max reductions; training per step and validation) equal one process, on every rank; MoE
auxiliary losses are added on the stages that own them (both layers of ``moe_llama``, one per stage)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.launcher import launch

CASES = {
    "plain_1f1b": ("llama", "logits", {"pp": 2, "dp_shard": 1}),
    "plain_interleaved": ("llama8", "logits", {"pp": 2, "dp_shard": 1, "pp_schedule": "interleaved_1f1b"}),
    "hf_labels_gpipe": ("hf_llama", "labels", {"pp": 2, "dp_shard": 1, "pp_schedule": "gpipe"}),
    "moe_aux_losses": ("moe_llama", "aux", {"pp": 2, "dp_shard": 1}),
    "moe_aux_losses_with_hooks": ("moe_llama", "hooks_aux", {"pp": 2, "dp_shard": 1}),
}


# What only the last stage finds wrong, and the words every rank of the pipeline raises it with.
FAULTS = {
    "predict_twice": r"Refused.predict_step` called the model 2 times in one step.*HINT: call the model once",
    "returns_none": r"Refused.training_step` returned NoneType for a microbatch.*HINT: return the loss tensor",
    "mean_of_losses": r"called `mean_loss.forward` with a value the microbatches cannot join, its argument 1: a Tensor"
                      r" that differs between microbatches.*HINT: pass the metric per-sample values",
}


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return launch("tests.distributed.own_steps_ranks:run", 2, tmp_path_factory.mktemp("own_steps"), timeout=600,
                  cases=CASES, faults=list(FAULTS))


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_only_the_last_stage_sees_is_raised_on_every_rank_with_its_fix(per_rank, fault):
    for result in per_rank:
        assert re.search(FAULTS[fault], result["refused"][fault], re.DOTALL), result["refused"][fault]


@pytest.mark.parametrize("case", CASES)
def test_logged_values_equal_one_process_on_every_rank(per_rank, case):
    reference = per_rank[0][case]["reference"]
    for result in per_rank:
        logged = result[case]["parallel"]["logged"]
        assert len(logged) == len(reference["logged"])
        for step, expected in zip(logged, reference["logged"]):
            for name, value in expected.items():
                assert step[name] == pytest.approx(value, rel=1e-6, abs=2e-6), (name, step, expected)
        for name, value in reference["val"].items():
            assert result[case]["parallel"]["val"][name] == pytest.approx(value, rel=1e-6, abs=2e-6), name


@pytest.mark.parametrize("case", CASES)
def test_training_equals_one_process(per_rank, case):
    reference = per_rank[0][case]["reference"]
    params, grads = {}, {}
    for result in per_rank:
        params |= result[case]["parallel"]["params"]
        grads |= result[case]["parallel"]["grads"]
    assert params.keys() == reference["params"].keys()
    for name, expected in reference["grads"].items():
        torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=2e-6, msg=lambda m: f"grad {name}: {m}")
    for name, expected in reference["params"].items():
        torch.testing.assert_close(params[name], expected, rtol=1e-4, atol=5e-5, msg=lambda m: f"param {name}: {m}")
