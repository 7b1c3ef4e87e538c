"""No silent wrong result: a model that a dim would train wrong stops `Trainer.fit` on every rank before the first
optimizer step, with a HINT (2 real ranks). The plan-time refusals are listed, one test each, in
tests/unit/test_errors.py; here they run through a real Trainer, with the runtime guard of cp."""

from __future__ import annotations

import pytest

from tests.launcher import launch

EXPECTED = {
    "cp_learned_positions": ["`LearnedPositions.forward` takes no `position_ids`", "HINT", "cp_positions='model'"],
    "cp_pooling": ["`PooledClassifier` returned a (2, 3) output for this rank's 8 tokens", "HINT"],
    "batch_norm_dp_shard": ["dp_shard=2", "BatchNorm1d", "HINT"],
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return launch("tests.distributed.refusals_ranks:run_all", 2, tmp_path_factory.mktemp("refusals"), timeout=300)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_refused_before_the_first_optimizer_step(outcomes, name):
    for rank, outcome in enumerate(outcomes):
        result = outcome[name]
        for fact in EXPECTED[name]:
            assert fact in result["message"], f"rank {rank}: {fact!r} missing from {result['message']!r}"
        assert result["optimizer_steps"] == 0 and result["global_step"] == 0 and result["unchanged"]
