"""Checkpoints of a pipeline whose first and last stage hold copies of one tied weight (a GPT's embedding and
head): the optimizer state is saved once, under the embedding's name as one process's optimizer keys it, the
weights under both names as one process's state dict has them; a resume on the same layout continues the loss
curve bit for bit, and other layouts (one copy under dp, two on one rank under a V-shaped schedule, pp=4 from a
one-file export) load the saved weight into every copy and take the same next two steps. Built on the meta
device, the copies start equal (the first stage's values are sent to the last) and stay equal.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.checkpoint_ranks import SAVE_EVERY, STEPS
from tests.launcher import launch

BASE = {"pp": 2, "dp_shard": 2}
LAYOUTS = {"dp4": {"dp_shard": 4}, "pp2_zbv_dp2": {"pp": 2, "dp_shard": 2, "pp_schedule": "zbv"},
           "full_pp4": {"pp": 4, "dp_shard": 1}}
COPY, WEIGHT = "out.weight", "tok.weight"  # the head's copy on the last stage, the embedding's on the first


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied_ckpt")
    return launch("tests.distributed.pipeline_ranks:tied_checkpoint", 4, root / "out", timeout=900,
                  ckpt_dir=str(root / "ckpt"), export_to=str(root / "full.ckpt"), base=BASE, layouts=LAYOUTS)


def _merged(results: list, run: str, what: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for rank_result in results:
        merged.update(rank_result[run][what])
    return merged


def test_the_tied_weight_has_one_optimizer_state_and_both_names_for_its_values(results):
    keys = results[0]["saved_keys"]
    assert "model.model.tok.weight" in keys and "model.model.out.weight" in keys
    assert any(key.startswith("optimizer_0.state.model.tok.weight.") for key in keys)
    assert not any(key.startswith("optimizer_0.state.model.out.weight.") for key in keys)


def test_resume_on_the_same_layout_continues_the_loss_curve_exactly(results):
    uninterrupted = results[0]["uninterrupted"]["losses"]
    assert len(uninterrupted) == STEPS
    assert results[0]["same_layout"]["losses"] == uninterrupted[SAVE_EVERY:]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_other_layouts_load_the_weight_into_every_copy_and_take_the_same_steps(results, layout):
    saved, loaded = _merged(results, "uninterrupted", "after"), _merged(results, layout, "loaded")
    assert loaded.keys() == (saved.keys() if "pp" in LAYOUTS[layout] else saved.keys() - {COPY})
    for key, value in loaded.items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    torch.testing.assert_close(saved[COPY], saved[WEIGHT], rtol=0, atol=0)
    expected = results[0]["uninterrupted"]["losses"][SAVE_EVERY:SAVE_EVERY + 2]
    torch.testing.assert_close(results[0][layout]["losses"], expected, rtol=1e-5, atol=1e-5)


def test_built_on_meta_the_copies_start_equal_and_stay_equal(results):
    for when in ("loaded", "final"):
        merged: dict[str, torch.Tensor] = {}
        for rank_result in results:
            merged.update(rank_result["on_meta"][when])
        torch.testing.assert_close(merged[COPY], merged[WEIGHT], rtol=0, atol=0, msg=lambda m: f"{when}: {m}")
    # The model's own init (its constructor's `init_weights`: std 0.02), not the embedding's default N(0, 1).
    start = {name: value for rank_result in results for name, value in rank_result["on_meta"]["loaded"].items()}
    assert start[WEIGHT].std().item() == pytest.approx(0.02, rel=0.1)
