"""Context parallelism matches one process: loss per step, gradients and parameters after 5 AdamW
steps (fp32), for cp=2 alone (and with full and selective recomputation) and composed with FSDP (dp_shard x cp), TP (+SP) and PP, on the example
Llama (rotary positions from `position_ids`), the GPT-style model (learned positions) and a Hugging
Face Llama with no edits (its SDPA calls are routed to ring attention, its positions injected).

Every rank of the cp group sees the same samples and a head-tail ("zigzag") shard of each sequence.
"""

from __future__ import annotations

import pytest

from tests.distributed.meta_starts_ranks import assert_starts_like_plain
from tests.distributed.parity_ranks import STEPS, assert_training_matches, launcher

CP2 = {"cp2": {"cp": 2, "dp_shard": 1}, "cp2_ac_full": {"cp": 2, "dp_shard": 1, "activation_checkpointing": "full"},
       # selective recomputation keeps the fused kernels' outputs inside the ring and re-runs its hops
       "cp2_ac_selective": {"cp": 2, "dp_shard": 1, "activation_checkpointing": "selective"}}
CP4 = {"cp4": {"cp": 4, "dp_shard": 1}, "cp2_fsdp2": {"cp": 2, "dp_shard": 2}, "cp2_tp2": {"cp": 2, "dp_shard": 1, "tp": 2},
       "cp2_tp2_sp": {"cp": 2, "dp_shard": 1, "tp": 2, "sequence_parallel": True},
       "cp2_pp2": {"cp": 2, "dp_shard": 1, "pp": 2}}
# (world size, model, layouts, per-rank batch)
LAUNCHES = {"llama_cp2": (2, "llama", CP2, 2), "llama_cp4": (4, "llama8", CP4, 4), "gpt_cp2": (2, "gpt", CP2, 2),
            "hf_cp2": (2, "hf_llama", {"cp2": CP2["cp2"]}, 2)}
CASES = [(name, layout) for name, (_, _, layouts, _) in LAUNCHES.items() for layout in layouts]
# Models built in `configure_model` (tests/distributed/meta_starts_ranks.py), started in the cp4 launch.
STARTS = {"llama_cp4": {f"{model}_cp2_fsdp2": (model, CP4["cp2_fsdp2"]) for model in ("gpt", "own_init", "llama")}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launcher(tmp_path_factory, LAUNCHES, starts=STARTS)


@pytest.mark.parametrize("start", list(STARTS["llama_cp4"]))
def test_a_model_built_in_configure_model_starts_as_plain_construction(runs, start):
    assert_starts_like_plain(runs("llama_cp4"), start, STARTS["llama_cp4"][start][0])


@pytest.mark.parametrize("launch_name, layout", CASES)
def test_context_parallel_matches_one_process(runs, launch_name, layout):
    per_rank = runs(launch_name)
    assert len(per_rank[0][layout]["parallel"]["losses"]) == STEPS
    assert_training_matches(per_rank, layout, "context_parallel")
