"""``ckpt_path="auto"`` on 2 ranks (`resume_ranks.py`): a first run finds nothing and says so once; when the newest
checkpoint fails to load (its checksums) the one before is loaded, with a warning, and training continues exactly as
a resume from that one, the damaged folder left as it was; a checkpoint of a model of another vocabulary is refused
before any step, naming both shapes."""

from __future__ import annotations

import pytest
import torch

from tests.launcher import launch


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto_resume")
    ranks = launch("tests.distributed.resume_ranks:scenarios", 2, root / "out", timeout=300, root=str(root))
    return root, ranks


def test_a_first_run_finds_nothing_and_says_so_once(results):
    _, ranks = results
    fresh = [rank["fresh"] for rank in ranks]
    assert all(run["step"] == 6 and run["batches"] == 6 for run in fresh)
    said = [line for line in fresh[0]["said"] if "ckpt_path='auto'" in line]
    assert len(said) == 1 and "found no complete checkpoint" in said[0] and "starting from the first step" in said[0]
    assert not [line for line in fresh[1]["said"] if "ckpt_path='auto'" in line]  # rank 0 says it


def test_a_newest_checkpoint_that_fails_to_load_falls_back_to_the_one_before(results):
    root, ranks = results
    said = ranks[0]["damaged"]["said"]
    newest, older = root / "damaged" / "ckpt" / "step=6.ckpt", root / "damaged" / "ckpt" / "step=3.ckpt"
    warned = [line for line in said if f"could not load `{newest}`" in line]
    assert len(warned) == 1 and "does not match its checksum" in warned[0] and f"trying `{older}`" in warned[0]
    assert any(f"resumes from `{older}` (step 3)" in line and "1 newer could not be loaded" in line for line in said)
    for rank in ranks:
        damaged, reference = rank["damaged"], rank["reference"]
        assert damaged["step"] == 8 and damaged["losses"] == reference["losses"] and len(reference["losses"]) == 5
        for name, value in reference["loaded"].items():
            torch.testing.assert_close(damaged["loaded"][name], value, rtol=0, atol=0)
        assert damaged["kept"]  # the damaged folder is left as it was; the resumed run saved step 6 beside it
    assert sorted(p.name for p in (root / "damaged" / "ckpt").iterdir()) == ["step=3.ckpt", "step=6-v1.ckpt",
                                                                           "step=6.ckpt"]


def test_a_read_that_runs_out_of_memory_on_one_rank_falls_back_on_every_rank(results):
    root, ranks = results
    newest = root / "memory" / "ckpt" / "step=6.ckpt"
    warned = [line for line in ranks[0]["one_rank_out_of_memory"]["said"] if f"could not load `{newest}`" in line]
    assert len(warned) == 1 and "MemoryError: cannot allocate" in warned[0], ranks[0]["one_rank_out_of_memory"]["said"]
    for rank in ranks:
        run, reference = rank["one_rank_out_of_memory"], rank["reference"]
        assert run["step"] == 8 and run["losses"] == reference["losses"]


def test_a_checkpoint_of_another_vocabulary_is_refused_before_any_step_naming_both_shapes(results):
    _, ranks = results
    for rank in ranks:
        other = rank["other_vocabulary"]
        assert other["batches"] == 0, other
        assert "embed_tokens.weight` is [256, 64] in it, [512, 64] in this model" in other["refused"], other["refused"]
        assert "HINT:" in other["refused"]
