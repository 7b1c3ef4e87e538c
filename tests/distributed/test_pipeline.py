"""Pipeline parallelism matches one process: loss per step, gradients and parameters after 5 AdamW
steps (fp32), validation loss and predictions, for every schedule, with clipping and gradient
accumulation, at pp=2 and pp=4, and composed with FSDP and TP (8 ranks for pp x dp_shard x tp); a GPT
with tied input and output embeddings under looped and V-shaped schedules, FSDP, HSDP and TP; models built in
`configure_model` start as plain construction makes them.

Parameters live on the ranks of one stage only, so each rank's copies are merged by name: every
parameter of the reference must come from some rank, ranks of the same stage (dp/tp replicas) must
hold bit-equal copies, and no parameter may sit on two pipeline ranks, except a tied weight: one copy
on the first stage's ranks (under the embedding's name), one on the last stage's (under the head's).
"""

from __future__ import annotations

import pytest
import torch

from lightning_nd.pipeline_parallel.schedules import SCHEDULES, SINGLE_STAGE
from lightning_nd.pipeline_parallel.split import stage_ranks
from tests.distributed.meta_starts_ranks import assert_starts_like_plain
from tests.distributed.parity_ranks import assert_training_matches, launcher
from tests.launcher import launch

PP2 = {f"pp2_{name}": {"pp": 2, "dp_shard": 1, "pp_schedule": name} for name in SCHEDULES}
PP2 |= {"pp2_1f1b_clip": {"pp": 2, "dp_shard": 1}, "pp2_interleaved_accum": {"pp": 2, "dp_shard": 1,
                                                                           "pp_schedule": "interleaved_1f1b"}}
PP4 = {f"pp4_{name}": {"pp": 4, "dp_shard": 1, "pp_schedule": name} for name in ("gpipe", "1f1b", "interleaved_1f1b")}
PP4 |= {"pp4_zbv": {"pp": 4, "dp_shard": 1, "pp_schedule": "zbv"},
        "pp2_fsdp2": {"pp": 2, "dp_shard": 2}, "pp2_fsdp2_accum": {"pp": 2, "dp_shard": 2},
        "pp2_tp2": {"pp": 2, "dp_shard": 1, "tp": 2},
        "pp2_tp2_sp": {"pp": 2, "dp_shard": 1, "tp": 2, "sequence_parallel": True},
        "pp2_tp2_sp_loss_parallel": {"pp": 2, "dp_shard": 1, "tp": 2, "sequence_parallel": True, "loss_parallel": True}}
PP8 = {"pp2_fsdp2_tp2": {"pp": 2, "dp_shard": 2, "tp": 2},
       "pp2_fsdp2_tp2_sp_clip": {"pp": 2, "dp_shard": 2, "tp": 2, "sequence_parallel": True}}
HF = {"pp2_hf_declared_plan": {"pp": 2, "dp_shard": 1}}
TIED = {"tied_pp2_fsdp2_clip": {"pp": 2, "dp_shard": 2},
        "tied_pp2_fsdp2_zbv": {"pp": 2, "dp_shard": 2, "pp_schedule": "zbv"},
        "tied_pp4_1f1b": {"pp": 4, "dp_shard": 1},
        "tied_pp2_tp2_gpipe": {"pp": 2, "dp_shard": 1, "tp": 2, "pp_schedule": "gpipe"},
        "tied_pp2_hsdp_accum": {"pp": 2, "dp_replicate": 2, "dp_shard": 1}}
CLIP = {"pp2_1f1b_clip": 0.5, "pp2_fsdp2_tp2_sp_clip": 0.5, "tied_pp2_fsdp2_clip": 0.2}
ACCUMULATE = {"pp2_interleaved_accum": 2, "pp2_fsdp2_accum": 2, "tied_pp2_hsdp_accum": 2}
# (world size, model, layouts, per-rank batch: a multiple of the microbatches, 2 x pp by default)
LAUNCHES = {"pp2": (2, "llama8", PP2, 4), "pp4": (4, "llama8", PP4, 8), "pp8": (8, "llama8", PP8, 4),
            "hf": (2, "hf_llama", HF, 4), "tied": (4, "gpt4", TIED, 8)}
CASES = [(launch_name, layout) for launch_name, (_, _, layouts, _) in LAUNCHES.items() for layout in layouts]
# Models built in `configure_model` (tests/distributed/meta_starts_ranks.py), started in the tied launch: a tie spanning
# stages (the GPTs' heads) held on two ranks, on one rank (zbv), and a tie inside one stage (own_init's norms).
PP2_FSDP2 = {"pp": 2, "dp_shard": 2}
STARTS = {"tied": {"gpt_pp2_fsdp2": ("gpt", PP2_FSDP2), "gpt_pp4": ("gpt", {"pp": 4, "dp_shard": 1}),
                   "gpt_pp2_zbv": ("gpt", {**PP2_FSDP2, "pp_schedule": "zbv"}),
                   "own_init_pp2_fsdp2": ("own_init", PP2_FSDP2), "llama_pp2_fsdp2": ("llama", PP2_FSDP2)}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launcher(tmp_path_factory, LAUNCHES, starts=STARTS, clip=CLIP, accumulate=ACCUMULATE)


@pytest.mark.parametrize("start", list(STARTS["tied"]))
def test_a_model_built_in_configure_model_starts_as_plain_construction(runs, start):
    assert_starts_like_plain(runs("tied"), start, STARTS["tied"][start][0])


@pytest.mark.parametrize("launch_name, layout", CASES)
def test_pipeline_matches_one_process(runs, launch_name, layout):
    assert_training_matches(runs(launch_name), layout, "pipeline_split", CLIP.get(layout))


@pytest.mark.parametrize("launch_name, layout", CASES)
def test_validation_and_predictions_match_one_process(runs, launch_name, layout):
    per_rank = runs(launch_name)
    reference = per_rank[0][layout]["reference"]
    for result in per_rank:
        parallel = result[layout]["parallel"]
        assert parallel["val_loss"] == pytest.approx(reference["val_loss"], abs=2e-6, rel=1e-6)
        # Each data-parallel rank predicts every dp-th sample (Lightning's sampler, no shuffle).
        expected = reference["val_logits"][parallel["dp_rank"]::parallel["dp"]]
        torch.testing.assert_close(parallel["predictions"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("launch_name", list(LAUNCHES))
def test_each_rank_holds_only_its_stages(runs, launch_name):
    world, _, layouts, _ = LAUNCHES[launch_name]
    per_rank = runs(launch_name)
    for layout, options in layouts.items():
        pp, rest = options["pp"], world // options["pp"]
        by_pp_rank = [set(per_rank[r * rest][layout]["parallel"]["params"]) for r in range(pp)]
        for a in range(pp):
            for b in range(a + 1, pp):
                assert not by_pp_rank[a] & by_pp_rank[b], f"{layout}: pp ranks {a} and {b} share parameters"
        reference = per_rank[0][layout]["reference"]
        assert set().union(*by_pp_rank) == set(reference["params"]) | set(reference["tied"])
        schedule = options.get("pp_schedule", "1f1b")
        ranks = stage_ranks(pp, 1 if schedule in SINGLE_STAGE else 2, schedule)
        owner = {index: r for r, held in enumerate(ranks) for index in held}
        first, last = owner[0], owner[len(owner) - 1]
        for copy, weight in reference["tied"].items():  # the head's copy on the last stage, the weight on the first
            assert [r for r in range(pp) if copy in by_pp_rank[r]] == [last], (layout, copy)
            assert [r for r in range(pp) if weight in by_pp_rank[r]] == [first], (layout, weight)


@pytest.mark.parametrize("launch_name", list(LAUNCHES))
def test_stage_timings_split_each_step_into_compute_and_idle(runs, launch_name):
    for result in runs(launch_name):
        for layout in LAUNCHES[launch_name][2]:
            timings = result[layout]["parallel"]["timings"]
            assert timings["step_s"] > timings["compute_s"] > 0  # the stages' forward/backward were timed
            assert 0 < timings["idle_fraction"] < 1


def test_a_batch_the_microbatches_do_not_divide_stops_every_rank_with_a_hint(tmp_path):
    with pytest.raises(RuntimeError) as failed:
        launch("tests.distributed.parity_ranks:run_layouts", 2, tmp_path, timeout=300, model_name="llama8",
               layouts={"pp2": {"pp": 2, "dp_shard": 1}}, batch={"pp2": 3})
    report = str(failed.value)
    assert "exit codes {0: 1, 1: 1}" in report  # both ranks raised (none killed after a hang)
    assert report.count("pp_microbatches=4 does not divide") >= 2 and "HINT" in report


def test_a_short_last_batch_resizes_the_pipeline_and_matches_one_process(tmp_path):
    per_rank = launch("tests.distributed.pipeline_ranks:short_last_batch", 2, tmp_path, timeout=300)
    expected = per_rank[0]["expected"]
    assert len(expected) == 2
    for result in per_rank:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=1e-6, atol=2e-6)
