"""Ranks forked from the zygotes (`tests/zygote.py`) are what fresh ``python -m tests.worker`` processes would be:
their own environment, rank and hash seed, torch's initial random state, one thread, and the same exit codes and
logs; a rank whose environment the zygotes cannot give starts fresh."""

from __future__ import annotations

import pytest
import torch

from tests.launcher import exits, launch, start
from tests.zygotes import Rank

SCENARIO = "tests.distributed.zygote_ranks"


def test_forked_ranks_are_fresh_processes(tmp_path):
    procs = start(f"{SCENARIO}:describe", 4, tmp_path / "a")
    assert all(isinstance(proc, Rank) for proc, _ in procs), [type(proc) for proc, _ in procs]
    assert exits(procs, timeout=120) and all(proc.returncode == 0 for proc, _ in procs)
    ranks = [torch.load(tmp_path / "a" / f"rank{r}.pt", weights_only=False) for r in range(4)]
    for rank, seen in enumerate(ranks):
        assert seen["rank"] == seen["rank_zero_only"] == rank
        generator = torch.Generator().manual_seed(seen["initial_seed"])  # nothing drew from it before the rank
        assert torch.equal(seen["torch_draw"], torch.rand(4, generator=generator))
        assert seen["faulthandler"] and seen["threads"] == 1 and not seen["cuda_initialised"]
        assert seen["main"] == "__main__" and seen["argv"][0].endswith("tests/worker.py"), seen["argv"]
        assert seen["argv"][1] == f"{SCENARIO}:describe"
        log = (tmp_path / "a" / f"rank{rank}.log").read_text()
        assert f"rank {rank} to stdout" in log and f"rank {rank} to stderr" in log
    assert len({seen["hash"] for seen in ranks}) == 4, "ranks share a hash seed"
    assert len({seen["initial_seed"] for seen in ranks}) == 4, "ranks share torch's seed (a fresh process draws one)"
    assert len({seen["numpy_draw"] for seen in ranks}) == 4, "ranks share numpy's random state"


def test_the_environment_a_fork_reads_again(tmp_path):
    """Variables torch and Python read at start, which the fork sets before the rank runs."""
    seen = launch(f"{SCENARIO}:describe", 2, tmp_path, environment={
        "PYTHONFAULTHANDLER": None, "TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert [s["faulthandler"] for s in seen] == [False, False]
    assert [s["debug_level"] for s in seen] == ["DebugLevel.DETAIL"] * 2


def test_a_rank_ends_as_a_fresh_process_would(tmp_path):
    codes = {}
    for how in ("exit_3", "raise", "os_exit_5", "sigkill"):
        procs = start(f"{SCENARIO}:end", 1, tmp_path / how, how=how)
        codes[how] = exits(procs, timeout=60)[0][0]
        assert "before the end" in (tmp_path / how / "rank0.log").read_text()
    assert codes == {"exit_3": 3, "raise": 1, "os_exit_5": 5, "sigkill": -9}
    assert "RuntimeError: raised in the rank" in (tmp_path / "raise" / "rank0.log").read_text()


def test_an_environment_the_zygotes_cannot_give_starts_fresh(tmp_path):
    with pytest.warns(UserWarning, match="differs from the zygotes' in OMP_NUM_THREADS"):
        procs = start(f"{SCENARIO}:describe", 1, tmp_path, environment={"OMP_NUM_THREADS": "2"})
    assert not isinstance(procs[0][0], Rank)
    assert exits(procs, timeout=300)[0][0] == 0
    assert torch.load(tmp_path / "rank0.pt", weights_only=False)["threads"] == 2
