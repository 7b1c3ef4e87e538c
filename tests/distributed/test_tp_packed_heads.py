"""A fused ``[q; k; v]`` whose parts are sized by head counts (LitGPT's ``attn.qkv``: queries, then keys, then
values), split by heads over 2 ranks, computes what the whole model does (output and every parameter's gradient,
float64): grouped-query attention with biases on both layers, four query heads per key/value head, multi-head
attention, under sequence parallelism, and another codebase's attention keeping its counts on itself; its sharded
checkpoint holds the whole tensors in the model's own order (`lightning_nd/tensor_parallel/apply/packed_heads.py`).
The planning rules: tests/unit/test_tp_fused_heads.py."""

from __future__ import annotations

import pytest

from tests.distributed.packed_heads_ranks import LITGPT
from tests.launcher import launch

pytest.importorskip("litgpt")


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    folder = tmp_path_factory.mktemp("packed_heads")
    return launch("tests.distributed.packed_heads_ranks:compare", 2, folder, timeout=180, folder=str(folder))


@pytest.mark.parametrize("case", [*LITGPT, "sequence_parallel", "counts_on_the_module"])
def test_a_fused_projection_split_by_heads_matches_the_whole_model(per_rank, case):
    for rank, results in enumerate(per_rank):
        differences = dict(results[case])
        assert differences.pop("split") == 1.0, f"rank {rank}: the fused projection was not split part by part"
        # LitGPT's RMSNorm computes in float32 (`x.float()`); under SP its weight's gradient is summed from sequence
        # shards, in another order than one process sums it
        tolerance = 1e-7 if case == "sequence_parallel" else 1e-12
        assert max(differences.values()) < tolerance, (rank, differences)


def test_its_sharded_checkpoint_holds_the_whole_tensors_in_the_model_order(per_rank):
    assert per_rank[0]["grouped_biases"]["checkpoint"] == 0.0
