"""A weight packed part by part over tp (``_StridedShard``: a fused ``[gate; up]``, experts' ``gate_up_proj`` under
expert tensor parallelism) is written to a sharded checkpoint where the whole tensor has it, and read back into
its own shards: DCP alone puts rank 1's shard of ``[gate; up]`` at the wrong offset
(`lightning_nd/checkpoint/strided.py`)."""

from __future__ import annotations

from tests.launcher import launch


def test_a_packed_shard_is_saved_and_loaded_where_the_whole_tensor_has_it(tmp_path):
    per_rank = launch("tests.distributed.strided_checkpoint_ranks:round_trip", 2, tmp_path, timeout=120, folder=str(tmp_path))
    assert per_rank[0]["written_equal"] is True  # read back in one process: the whole tensor, in the model's order
    for rank, result in enumerate(per_rank):
        assert result["kept"] and result["loaded_in_place"], (rank, result)
        assert result["local_equal"] and result["whole_equal"], (rank, result)
