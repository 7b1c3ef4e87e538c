"""Ring and all-gather attention equal plain attention: outputs and dq/dk/dv, on every rank, for cp=2
and cp=4, causal (zigzag and contiguous sharding) and full, multi-head and grouped-query, fp64 and fp32."""

from __future__ import annotations

import pytest

from lightning_nd.context_parallel.sharding import attention_flops_per_rank, shard_positions
from tests.launcher import launch

TOLERANCE = {"float64": 1e-12, "float32": 2e-5}


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return launch("tests.distributed.ring_attention_ranks:run_all", 4, tmp_path_factory.mktemp("ring"), timeout=600)


def test_every_case_matches_plain_attention_on_every_rank(per_rank):
    assert len(per_rank[0]) == 48  # 2 cp x 2 dtypes x (2 causal shardings + 1 full) x 2 kv-head counts x 2 impls
    for rank, cases in enumerate(per_rank):
        for case, errors in cases.items():
            tolerance = TOLERANCE[case.split("-")[1]]
            for quantity, error in errors.items():
                assert error <= tolerance, f"rank {rank} {case} {quantity}: {error:.2e} > {tolerance:.0e}"


def test_zigzag_gives_every_rank_the_same_causal_work():
    zigzag = attention_flops_per_rank(4096, 4, "zigzag")
    contiguous = attention_flops_per_rank(4096, 4, "contiguous")
    assert max(zigzag) == min(zigzag)
    assert max(contiguous) / (sum(contiguous) / 4) > 1.7  # the last rank does ~7/4 of the mean


def test_zigzag_holds_one_early_and_one_late_chunk():
    assert shard_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="HINT"):
        shard_positions(10, 4, 0)
