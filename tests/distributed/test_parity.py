"""Every layout matches one process: loss per step, final gradients and final parameters after 5
AdamW steps in float32, for three models of different structure (see tests/models.py); and models built in
`configure_model` start as plain construction makes them (tests/distributed/meta_starts_ranks.py).

One launch of 4 ranks per model trains all layouts (tests/distributed/parity_ranks.py); each layout is
then its own test here. Tolerances: float32 reductions in a different order differ by ~1e-7
relative; five Adam steps at lr=1e-3 keep parameter differences below ~2e-5 (the measured maxima over
all layouts and models are in docs/pages/performance.md, "How correct is it").
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.litgpt_models import AVAILABLE as LITGPT_AVAILABLE
from tests.distributed.litgpt_models import PREFIX, PRETRAINING_INIT
from tests.distributed.meta_starts_ranks import assert_starts_like_plain
from tests.distributed.parity_ranks import ACCUMULATE, STEPS, assert_layout_matches_shards, techniques
from tests.launcher import launch

WORLD = 4
LAYOUTS = {
    "fsdp4": {"dp_shard": 4},
    "hsdp_2x2_clip": {"dp_replicate": 2, "dp_shard": 2},
    "ddp4": {"dp_replicate": 4, "dp_shard": 1},
    "zero1_accum": {"dp_shard": 4, "zero_stage": 1},
    "zero2_accum": {"dp_shard": 4, "zero_stage": 2},
    "zero3_accum": {"dp_shard": 4, "zero_stage": 3},
    "cpu_offload": {"dp_shard": 4, "cpu_offload": True},
    "ddp2_tp2": {"dp_replicate": 2, "dp_shard": 1, "tp": 2},
    "ddp2_tp2_sp": {"dp_replicate": 2, "dp_shard": 1, "tp": 2, "sequence_parallel": True},
    "tp4": {"tp": 4},
    "tp4_sp": {"tp": 4, "sequence_parallel": True},
    "tp4_sp_clip": {"tp": 4, "sequence_parallel": True},
    "fsdp2_tp2_clip": {"dp_shard": 2, "tp": 2},
    "fsdp2_tp2_sp_loss_parallel": {"dp_shard": 2, "tp": 2, "sequence_parallel": True, "loss_parallel": True},
    "fsdp4_ac_full": {"dp_shard": 4, "activation_checkpointing": "full"},
    "fsdp2_tp2_ac_selective": {"dp_shard": 2, "tp": 2, "activation_checkpointing": "selective"},
    # aot_eager runs the whole torch.compile stack but inductor's codegen (tests/distributed/test_compile.py).
    "fsdp4_compile": {"dp_shard": 4, "compile": "aot_eager"},
}
CLIP = {"hsdp_2x2_clip": 0.5, "tp4_sp_clip": 0.5, "fsdp2_tp2_clip": 1.0}
ACCUMULATING = {name: ACCUMULATE for name in LAYOUTS if name.endswith("_accum")}
MODELS = ("llama", "gpt", "hf_llama")
# GPT's head is tied to its embedding, so it stays whole and loss parallel is refused (tests/unit).
NOT_FOR = {"gpt": {"fsdp2_tp2_sp_loss_parallel"}}


# Models built in `configure_model` (tests/distributed/meta_starts_ranks.py), started inside the same launches: by launch,
# start -> (model, layout). "single" is a launch of its own: one process, dp_shard=1 (no DTensor at all).
META = {"tp4": {"tp": 4}, "fsdp4": {"dp_shard": 4}, "fsdp2_tp2": {"dp_shard": 2, "tp": 2},
        "hsdp_2x2": {"dp_replicate": 2, "dp_shard": 2}, "pp2_fsdp2": {"pp": 2, "dp_shard": 2},
        "pp2_tp2": {"pp": 2, "dp_shard": 1, "tp": 2}, "ep2_fsdp4": {"dp_shard": 4, "ep": 2}}
# Every LitGPT model of tests/distributed/litgpt_models.py, each under a layout it can carry (multi-query falcon is
# refused under tp), started inside the Llama launch; tests/distributed/test_families.py trains some from that start.
LITGPT_STARTS = {"llama3": "fsdp2_tp2", "mixtral": "ep2_fsdp4", "gemma2": "pp2_tp2", "phi2": "tp4", "pythia": "pp2_fsdp2",
                 "qwen2.5": "hsdp_2x2", "stablelm": "fsdp2_tp2", "falcon": "pp2_fsdp2", "qwen3_moe": "ep2_fsdp4",
                 "olmo2": "pp2_tp2", "shared_grouped_moe": "ep2_fsdp4", "latent": "fsdp2_tp2",
                 "llama3" + PRETRAINING_INIT: "pp2_tp2"}
STARTS = {
    "single": {f"{model}_single": (model, {"dp_shard": 1}) for model in ("gpt", "own_init", "llama", "moe")},
    "gpt": {f"{model}_{name}": (model, META[name]) for model in ("gpt", "own_init")
            for name in ("tp4", "fsdp4", "fsdp2_tp2", "hsdp_2x2")},
    "llama": {f"llama_{name}": ("llama", META[name]) for name in ("tp4", "fsdp2_tp2")} | ({
        f"litgpt_{key}_{name}": (PREFIX + key, META[name]) for key, name in LITGPT_STARTS.items()
    } if LITGPT_AVAILABLE else {}),  # tests/unit/test_litgpt_install.py fails when litgpt is missing
    "hf_llama": {f"hf_llama_{name}": ("hf_llama", META[name]) for name in ("fsdp4", "tp4")},
}
START_CASES = [(launch_name, start) for launch_name, starts in STARTS.items() for start in starts]


def start_batches(launch_name: str) -> dict[str, int]:
    """Per-rank batches of the starts under pp: two microbatches of one sample per stage (the default schedule's)."""
    return {start: 4 for start, (_, layout) in STARTS.get(launch_name, {}).items() if layout.get("pp", 1) > 1}


def layouts_for(model_name: str) -> dict[str, dict]:
    return {name: layout for name, layout in LAYOUTS.items() if name not in NOT_FOR.get(model_name, ())}


CASES = [(model_name, layout) for model_name in MODELS for layout in layouts_for(model_name)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 4-rank launch per model (and one process for "single"), made when its first test needs it."""
    per_model: dict[str, list] = {}

    def run(model_name: str) -> list:
        if model_name not in per_model:
            single = model_name == "single"
            per_model[model_name] = launch(
                "tests.distributed.parity_ranks:run_layouts", 1 if single else WORLD,
                tmp_path_factory.mktemp(f"parity_{model_name}"), timeout=900, model_name=model_name,
                layouts={} if single else layouts_for(model_name), clip=CLIP, accumulate=ACCUMULATING,
                starts=STARTS.get(model_name, {}), batch=start_batches(model_name),
            )
        return per_model[model_name]

    return run


@pytest.mark.parametrize("model_name, layout", CASES)
def test_layout_matches_one_process(runs, model_name, layout):
    per_rank = runs(model_name)
    parallel, reference = per_rank[0][layout]["parallel"], per_rank[0][layout]["reference"]
    assert len(parallel["losses"]) == STEPS * ACCUMULATING.get(layout, 1)
    step_losses = torch.tensor(parallel["losses"]).view(STEPS, -1).mean(dim=1)
    torch.testing.assert_close(step_losses, torch.tensor(reference["losses"]), rtol=1e-6, atol=2e-6)
    assert parallel["params"].keys() == reference["params"].keys()
    for name, expected in reference["grads"].items():
        torch.testing.assert_close(parallel["grads"][name], expected, rtol=1e-4, atol=2e-6, msg=lambda m: f"grad {name}: {m}")
    for name, expected in reference["params"].items():
        torch.testing.assert_close(parallel["params"][name], expected, rtol=1e-4, atol=5e-5, msg=lambda m: f"param {name}: {m}")


@pytest.mark.parametrize("model_name, layout", CASES)
def test_every_rank_holds_the_same_model(runs, model_name, layout):
    """A replica that drifted (a tp copy of a norm, say) is invisible in rank 0's full tensors."""
    per_rank = runs(model_name)
    expected = per_rank[0][layout]["parallel"]["params"]
    for rank in range(1, WORLD):
        for name, value in per_rank[rank][layout]["parallel"]["params"].items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("model_name", MODELS)
def test_each_layout_applied_what_it_asked_for(runs, model_name):
    """The parity above is only meaningful if the techniques really ran."""
    per_rank = runs(model_name)
    applied = {name: techniques(r["parallel"]) for name, r in per_rank[0].items() if "parallel" in r}
    details = lambda name, technique: applied[name][technique]["details"]  # noqa: E731
    assert details("fsdp4", "fsdp") | {"units": None} == {"replicate": 1, "shard": 4, "zero_stage": 3, "units": None}
    assert (details("hsdp_2x2_clip", "hsdp")["replicate"], details("hsdp_2x2_clip", "hsdp")["shard"]) == (2, 2)
    assert (details("ddp4", "hsdp")["replicate"], details("ddp4", "hsdp")["shard"]) == (4, 1)
    assert details("zero1_accum", "fsdp")["zero_stage"] == 1 and details("zero2_accum", "fsdp")["zero_stage"] == 2
    assert details("tp4_sp_clip", "tensor_parallel")["tp"] == 4
    assert details("tp4_sp_clip", "tensor_parallel")["sequence_parallel"] is True
    assert "fsdp" not in applied["tp4"] and "hsdp" not in applied["tp4"]
    assert details("fsdp4_ac_full", "activation_checkpointing")["mode"] == "full"
    assert details("fsdp2_tp2_ac_selective", "activation_checkpointing")["mode"] == "selective"
    if model_name not in NOT_FOR:
        assert details("fsdp2_tp2_sp_loss_parallel", "tensor_parallel")["loss_parallel"] is True
    compiled = applied["fsdp4_compile"]["compile"]
    assert compiled["details"]["backend"] == "aot_eager" and len(compiled["modules"]) == 2
    for name, records in applied.items():  # every technique touched parameters (context parallel splits none)
        assert all(r["parameters"] > 0 for r in records.values()), (name, records)


@pytest.mark.parametrize("model_name", MODELS)
def test_each_rank_holds_what_its_layout_says(runs, model_name):
    """The Layout's per-rank parameter bytes (unpadded and FSDP-padded) equal the shards after parallelize."""
    for layout in layouts_for(model_name):
        assert_layout_matches_shards(runs(model_name), layout)


@pytest.mark.parametrize("model_name", MODELS)
def test_clipping_was_active(runs, model_name):
    """A clip that never fires proves nothing: the unclipped reference norm must exceed the threshold."""
    by_layout = runs(model_name)[0]
    for layout, max_norm in CLIP.items():
        assert by_layout[layout]["reference"]["max_unclipped_norm"] > max_norm, layout


@pytest.mark.parametrize("launch_name, start", START_CASES)
def test_a_model_built_in_configure_model_starts_as_plain_construction(runs, launch_name, start):
    """Its tensors, ties (so its parameter count), inits and first-step loss are plain construction's."""
    assert_starts_like_plain(runs(launch_name), start, STARTS[launch_name][start][0])
