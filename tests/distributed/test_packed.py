"""The ``packed_colwise`` style: a fused ``[gate; up]`` projection split half by half matches one
process, with FSDP too (its bias whole over tp, sharded by FSDP), and its full tensor keeps the model's own row
order (what checkpoints hold)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.parity_ranks import assert_layout_matches_shards, techniques
from tests.launcher import launch

LAYOUTS = {
    "ddp2_tp2": {"dp_replicate": 2, "dp_shard": 1, "tp": 2},
    "fsdp2_tp2_sp": {"dp_shard": 2, "tp": 2, "sequence_parallel": True},
    "tp4": {"tp": 4},
}


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return launch("tests.distributed.parity_ranks:run_layouts", 4, tmp_path_factory.mktemp("packed"), timeout=600,
                  model_name="fused_llama", layouts=LAYOUTS)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_projection_matches_one_process(per_rank, layout):
    parallel, reference = per_rank[0][layout]["parallel"], per_rank[0][layout]["reference"]
    assert techniques(parallel)["tensor_parallel"]["details"]["source"] == "name patterns"
    assert_layout_matches_shards(per_rank, layout)
    torch.testing.assert_close(torch.tensor(parallel["losses"]), torch.tensor(reference["losses"]), rtol=1e-6, atol=2e-6)
    for name, expected in reference["grads"].items():
        torch.testing.assert_close(parallel["grads"][name], expected, rtol=1e-4, atol=2e-6, msg=lambda m: f"grad {name}: {m}")
    for name, expected in reference["params"].items():
        torch.testing.assert_close(parallel["params"][name], expected, rtol=1e-4, atol=5e-5, msg=lambda m: f"param {name}: {m}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_holds_the_same_packed_model(per_rank, layout):
    expected = per_rank[0][layout]["parallel"]["params"]
    for rank in range(1, 4):
        for name, value in per_rank[rank][layout]["parallel"]["params"].items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=lambda m: f"rank {rank} {name}: {m}")
