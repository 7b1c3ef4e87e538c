"""Expert parallelism matches one process.

Layer: an MoE layer under ep=2 and ep=4 (4 ranks) equals the same layer on one process fed all ranks'
tokens (also a hand-written block whose experts are a `ModuleList` of MLPs, each rank holding only its experts), and
with each expert split over tp=2 (expert tensor parallelism) the same layer fed the same tokens, through 3 SGD steps
(parameters after them too): outputs, input/expert/router/shared-expert gradients, tokens per expert, the dropped
assignments under a capacity limit (the same ones), and the load-balancing loss (mean over ranks).
Training: loss per step, gradients and parameters after 5 AdamW steps through `Trainer`, for an MoE Llama
(8 experts, top-2) under ep=2 x dp_shard=2 (also with clipping, and with full activation checkpointing),
ep=4, ep=2 x tp=2 (dense layers split), ep=2 x pp=2, ep=2 x dp_shard=4 with gradient accumulation and
ep=2 x HSDP 2x2 (two ranks hold each expert), and a Hugging Face Mixtral under ep=2 with no user code; and with
each expert split over tp (expert tensor parallelism): the MoE Llama under dp_shard=2 x tp=2 and pp=2 x tp=2,
Mixtral (4 KV heads) under tp=4; split both ways (ep x tp, each expert on one ep rank, split over tp): the MoE
Llama's and Mixtral's ep=2 x dp_shard=2 x tp=2.
"""

from __future__ import annotations

import pytest

from tests.distributed.meta_starts_ranks import assert_starts_like_plain
from tests.distributed.parity_ranks import assert_training_matches, launcher, techniques
from tests.launcher import launch

TOLERANCE = {"float64": 1e-10, "float32": 2e-4}


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return launch("tests.distributed.expert_parallel_ranks:run_all", 4, tmp_path_factory.mktemp("ep"), timeout=600)


def test_expert_parallel_layer_matches_one_process(per_rank):
    # ep 2 and 4, and experts split over tp=2 (3 SGD steps), x dropless/capacity x top-1/top-2 x fp64/fp32
    assert len(per_rank[0]) == 34 and sum(key.startswith("etp2") for key in per_rank[0]) == 8
    for rank, cases in enumerate(per_rank):
        for case, result in cases.items():
            if case.startswith(("list", "noisy")):
                continue
            tolerance = TOLERANCE[case.rsplit("-", 1)[1]]
            for quantity, error in result["errors"].items():
                assert error <= tolerance, f"rank {rank} {case} {quantity}: {error:.2e}"
            parallel, reference = result["tokens_per_expert"]
            assert parallel == reference, f"rank {rank} {case}: tokens per expert {parallel} != {reference}"
            assert result["dropped"][0] == result["dropped"][1], f"rank {rank} {case}: dropped {result['dropped']}"
            assert result["balance"][0] == pytest.approx(result["balance"][1], rel=1e-6)


def test_experts_kept_in_a_list_train_under_ep_as_on_one_process(per_rank):
    # a hand-written block (gate Linear, ModuleList of MLPs called when chosen, shared expert) at ep 2 and 4 x top-1/
    # top-2 x fp64/fp32: each rank holds its E/ep experts under their own names, and 3 SGD steps match one process
    for rank, cases in enumerate(per_rank):
        lists = {case: result for case, result in cases.items() if case.startswith("list")}
        assert len(lists) == 8
        for case, result in lists.items():
            tolerance = TOLERANCE[case.rsplit("-", 1)[1]]
            for quantity, error in result["errors"].items():
                assert error <= tolerance, f"rank {rank} {case} {quantity}: {error:.2e}"
            held, expected = result["held"]
            assert held == expected, f"rank {rank} {case}: holds experts {held}, not {expected}"
            numel, share = result["expert_numel"]
            assert numel == share, f"rank {rank} {case}: {numel} expert parameters, not E/ep's {share}"


def test_listed_experts_that_draw_random_numbers_route_alike_in_both_passes(per_rank):
    # jitter in the routing and dropout in the experts: the second pass starts from the first one's random state
    for rank, cases in enumerate(per_rank):
        assert {case: cases[case] for case in ("noisy-ep2", "noisy-ep4")} == {"noisy-ep2": "ok", "noisy-ep4": "ok"}, rank


def test_capacity_really_drops_tokens_in_the_cases(per_rank):
    dropped = [result["dropped"][1] for key, result in per_rank[0].items() if "cap1.0" in key]
    assert min(dropped) > 0


LAUNCHES = {
    # CausalLM's step adds no auxiliary loss, and under pp the strategy adds the layers' own (their coefficients are
    # not 0): zero coefficients keep both sides alike; the auxiliary losses' parity under pp is test_own_steps.py's.
    "moe_ep2": (2, "moe_llama_no_aux", {"ep2_fsdp2": {"ep": 2, "dp_shard": 2}, "ep2_fsdp2_clip": {"ep": 2, "dp_shard": 2},
                                 "ep2_fsdp2_ac": {"ep": 2, "dp_shard": 2, "activation_checkpointing": "full"}}, 4),
    "moe_ep4": (4, "moe_llama_no_aux", {"ep4": {"ep": 4, "dp_shard": 4}, "ep2_tp2": {"ep": 2, "dp_shard": 2, "tp": 2},
                                 "ep2_pp2": {"ep": 2, "dp_shard": 2, "pp": 2},
                                 # two ranks hold each expert: their gradients are averaged across them
                                 "ep2_fsdp4_accum": {"ep": 2, "dp_shard": 4},
                                 "ep2_hsdp2x2": {"ep": 2, "dp_replicate": 2, "dp_shard": 2}}, 4),
    "mixtral_ep2": (2, "hf_mixtral", {"ep2_fsdp2": {"ep": 2, "dp_shard": 2}}, 4),
    # expert tensor parallelism: tp without ep splits every expert over tp
    "moe_etp": (4, "moe_llama_no_aux", {"etp_fsdp2_tp2": {"dp_shard": 2, "tp": 2}, "etp_pp2_tp2": {"pp": 2, "tp": 2}},
                4),
    "mixtral_etp": (4, "hf_mixtral_kv4", {"etp_tp4": {"tp": 4}, "etp_ep2_tp2": {"ep": 2, "dp_shard": 2, "tp": 2}}, 4),
}
ETP = {"moe_etp", "mixtral_etp"}
CLIP = {"ep2_fsdp2_clip": 0.5}
ACCUMULATE = {"ep2_fsdp4_accum": 2}
CASES = [(name, layout) for name, (_, _, layouts, _) in LAUNCHES.items() for layout in layouts]
# The example MoE model (conf/model/moe.yaml) built in `configure_model` (tests/distributed/meta_starts_ranks.py), started
# in the ep4 launch under ep and every other dim family.
# A Hugging Face Mixtral too: its `_init_weights` picks its experts by class, which the ep shards still are.
STARTS = {"moe_ep4": {f"moe_{name}": ("moe", layout) for name, layout in {
    "ep2_fsdp4": {"ep": 2, "dp_shard": 4}, "ep2_fsdp2_tp2": {"ep": 2, "dp_shard": 2, "tp": 2},
    "tp4": {"tp": 4}, "pp2_fsdp2": {"pp": 2, "dp_shard": 2}, "cp2_fsdp2": {"cp": 2, "dp_shard": 2}}.items()},
          "mixtral_ep2": {"hf_mixtral_ep2_fsdp2": ("hf_mixtral", {"ep": 2, "dp_shard": 2})}}
START_CASES = [(launch_name, start) for launch_name, starts in STARTS.items() for start in starts]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launcher(tmp_path_factory, LAUNCHES, starts=STARTS, clip=CLIP, accumulate=ACCUMULATE)


@pytest.mark.parametrize("launch_name, start", START_CASES)
def test_a_model_built_in_configure_model_starts_as_plain_construction(runs, launch_name, start):
    assert_starts_like_plain(runs(launch_name), start, STARTS[launch_name][start][0])


@pytest.mark.parametrize("launch_name, layout", CASES)
def test_training_under_expert_parallelism_matches_one_process(runs, launch_name, layout):
    applied = "expert_tensor_parallel" if launch_name in ETP else "expert_parallel"
    assert_training_matches(runs(launch_name), layout, applied, CLIP.get(layout))
    if "tp" in LAUNCHES[launch_name][2][layout] and "ep" in LAUNCHES[launch_name][2][layout]:  # split both ways
        assert {"expert_parallel", "expert_tensor_parallel"} <= set(techniques(runs(launch_name)[0][layout]["parallel"]))
