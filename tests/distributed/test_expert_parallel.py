"""An MoE layer under expert parallelism (ep=2 and ep=4, 4 ranks) equals the same layer on one process
fed all ranks' tokens: outputs, input/expert/router gradients, tokens per expert, dropped assignments
under a capacity limit (the same ones), and the load-balancing loss (mean over ranks)."""

from __future__ import annotations

import pytest

from tests.launcher import launch

TOLERANCE = {"float64": 1e-10, "float32": 2e-4}


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return launch("tests.distributed.ep_scenario:run_all", 4, tmp_path_factory.mktemp("ep"), timeout=600)


def test_expert_parallel_layer_matches_one_process(per_rank):
    assert len(per_rank[0]) == 16  # ep 2 and 4 x dropless/capacity x top-1/top-2 x fp64/fp32
    for rank, cases in enumerate(per_rank):
        for case, result in cases.items():
            tolerance = TOLERANCE[case.rsplit("-", 1)[1]]
            for quantity, error in result["errors"].items():
                assert error <= tolerance, f"rank {rank} {case} {quantity}: {error:.2e}"
            parallel, reference = result["tokens_per_expert"]
            assert parallel == reference, f"rank {rank} {case}: tokens per expert {parallel} != {reference}"
            assert result["dropped"][0] == result["dropped"][1], f"rank {rank} {case}: dropped {result['dropped']}"
            assert result["balance"][0] == pytest.approx(result["balance"][1], rel=1e-6)


def test_capacity_really_drops_tokens_in_the_cases(per_rank):
    dropped = [result["dropped"][1] for key, result in per_rank[0].items() if "cap1.0" in key]
    assert min(dropped) > 0
