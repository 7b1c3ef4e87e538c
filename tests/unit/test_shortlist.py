"""The layout search's plan (`lightning_nd/planner/shortlist.py`, `examples/search.py`), without running anything:
every candidate is a valid layout at the same global batch, the knobs vary (ZeRO stage, microbatches under pp),
distinct dim sizes come first, those predicted not to fit are dropped, and each candidate's command-line overrides
compose through Hydra into the very layout the planner costed."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from examples.schema import compose
from lightning_nd.cost.hardware import parse_hardware
from lightning_nd.mesh.dims import DIM_NAMES
from lightning_nd.planner.dry_run import dry_run
from lightning_nd.planner.search import describe_sizes
from lightning_nd.planner.shortlist import per_rank_batch, shortlist


def _model(cfg):
    from examples.search import meta_model
    from examples.train import model_factory

    return meta_model(model_factory(cfg.model))


@pytest.fixture(scope="module")
def planned():
    cfg = compose(["parallel=search", "trainer.devices=4"])
    return cfg, shortlist(_model(cfg), 4, 4, 6 * 10**9, cfg.data.seq_len, 32, hardware=parse_hardware("cpu"))


def test_every_candidate_is_a_layout_at_the_same_global_batch(planned):
    _, found = planned
    assert found.planned >= 10 and not found.dropped
    names = [describe_sizes(c.sizes) for c in found.ordered]
    distinct = list(dict.fromkeys(names))
    assert names[:len(distinct)] == distinct  # one per set of dim sizes first: the measured few differ
    assert {"dp_shard=4", "dp_shard=2,tp=2", "pp=2,dp_shard=2", "dp_shard=1,cp=4"} <= set(distinct)
    for candidate in found.ordered:
        batch_ranks = candidate.sizes["dp_replicate"] * candidate.sizes["dp_shard"]
        assert per_rank_batch(candidate) * batch_ranks == 32
        if candidate.sizes["pp"] > 1:
            assert per_rank_batch(candidate) % candidate.options["pp_microbatches"] == 0
        else:
            assert candidate.workload.accumulation == 1
    first = [c for c in found.ordered if names[found.ordered.index(c)] == distinct[0]]
    predicted = [c.cost.time.total_s for c in found.ordered[:len(distinct)]]
    assert predicted == sorted(predicted) and len(first) >= 1
    zero = {c.options["zero_stage"] for c in found.ordered if c.sizes["dp_shard"] > 1}
    microbatches = {c.options["pp_microbatches"] for c in found.ordered if c.sizes["pp"] == 2}
    assert zero == {1, 2, 3} and len(microbatches) > 1, (zero, microbatches)


def test_layouts_predicted_not_to_fit_are_dropped(planned):
    cfg, _ = planned
    found = shortlist(_model(cfg), 4, 4, 10**5, cfg.data.seq_len, 32, hardware=parse_hardware("cpu"))
    assert not found.ordered and found.dropped
    assert all(c.cost.peak.peak_bytes > 10**5 for c in found.dropped)


def test_each_candidates_overrides_compose_into_the_layout_the_planner_costed(planned):
    from examples.search import layout_overrides

    cfg, found = planned
    for candidate in found.ordered:
        overrides = layout_overrides(candidate)
        run = compose([*overrides, "trainer.devices=4"])
        assert run.data.batch_size == per_rank_batch(candidate)
        options = OmegaConf.to_container(run.parallel, resolve=True)
        sizes = {d: options.pop(d) for d in DIM_NAMES}
        layout = dry_run(_model(run), 4, sizes, options, seq_len=run.data.seq_len, micro_batch=run.data.batch_size)
        assert {d: layout.dims[d] for d in DIM_NAMES} == {d: candidate.layout.dims[d] for d in DIM_NAMES}, overrides
        mine, theirs = layout.options.to_dict(), candidate.layout.options.to_dict()
        for key in ("zero_stage", "activation_checkpointing", "sequence_parallel", "pp_schedule", "pp_microbatches"):
            if key != "zero_stage" or candidate.sizes["dp_shard"] > 1:
                assert mine[key] == theirs[key], (key, overrides)


def test_the_budget_flag_is_hydras_override():
    from examples.train import budget_flag

    assert budget_flag(["train.py", "-m", "--budget", "3", "x=1"]) == ["train.py", "-m", "search.budget=3", "x=1"]
    assert budget_flag(["train.py", "--budget=2"]) == ["train.py", "search.budget=2"]
    assert compose(["parallel=search", "search.budget=3"]).search.budget == 3
    with pytest.raises(Exception, match="search.budgte"):
        compose(["parallel=search", "search.budgte=3"])
