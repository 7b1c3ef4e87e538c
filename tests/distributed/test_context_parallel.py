"""Context parallelism matches one process: loss per step, gradients and parameters after 5 AdamW
steps (fp32), for cp=2 alone and composed with FSDP (dp_shard x cp), TP (+SP) and PP, on the example
Llama (rotary positions from `position_ids`), the GPT-style model (learned positions) and a Hugging
Face Llama with no edits (its SDPA calls are routed to ring attention, its positions injected).

Every rank of the cp group sees the same samples and a head-tail ("zigzag") shard of each sequence.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.parity import STEPS
from tests.launcher import launch

CP2 = {"cp2": {"cp": 2, "dp_shard": 1}, "cp2_ac_full": {"cp": 2, "dp_shard": 1, "activation_checkpointing": "full"}}
CP4 = {"cp4": {"cp": 4, "dp_shard": 1}, "cp2_fsdp2": {"cp": 2, "dp_shard": 2}, "cp2_tp2": {"cp": 2, "dp_shard": 1, "tp": 2},
       "cp2_tp2_sp": {"cp": 2, "dp_shard": 1, "tp": 2, "sequence_parallel": True},
       "cp2_pp2": {"cp": 2, "dp_shard": 1, "pp": 2}}
# (world size, model, layouts, per-rank batch)
LAUNCHES = {"llama_cp2": (2, "llama", CP2, 2), "llama_cp4": (4, "llama8", CP4, 4), "gpt_cp2": (2, "gpt", CP2, 2),
            "hf_cp2": (2, "hf_llama", {"cp2": CP2["cp2"]}, 2)}
CASES = [(name, layout) for name, (_, _, layouts, _) in LAUNCHES.items() for layout in layouts]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    done: dict[str, list] = {}

    def run(name: str) -> list:
        if name not in done:
            world, model, layouts, batch = LAUNCHES[name]
            done[name] = launch("tests.distributed.parity:run_layouts", world, tmp_path_factory.mktemp(name),
                                timeout=900, model_name=model, layouts=layouts, batch=dict.fromkeys(layouts, batch),
                                validate=list(layouts))
        return done[name]

    return run


def _merged(per_rank: list, layout: str, what: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for result in per_rank:
        for name, value in result[layout]["parallel"][what].items():
            if name in merged:
                torch.testing.assert_close(value, merged[name], rtol=0, atol=0, msg=lambda m: f"replicas of {name}: {m}")
            merged[name] = value
    return merged


@pytest.mark.parametrize("launch_name, layout", CASES)
def test_context_parallel_matches_one_process(runs, launch_name, layout):
    per_rank = runs(launch_name)
    parallel, reference = per_rank[0][layout]["parallel"], per_rank[0][layout]["reference"]
    assert any("context parallel" in line for line in parallel["applied"])
    torch.testing.assert_close(torch.tensor(parallel["losses"]), torch.tensor(reference["losses"]), rtol=1e-6, atol=2e-6)
    assert len(parallel["losses"]) == STEPS
    params, grads = _merged(per_rank, layout, "params"), _merged(per_rank, layout, "grads")
    assert params.keys() == reference["params"].keys()
    for name, expected in reference["grads"].items():
        torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=2e-6, msg=lambda m: f"grad {name}: {m}")
    for name, expected in reference["params"].items():
        torch.testing.assert_close(params[name], expected, rtol=1e-4, atol=5e-5, msg=lambda m: f"param {name}: {m}")
    for result in per_rank:
        assert result[layout]["parallel"]["val_loss"] == pytest.approx(reference["val_loss"], abs=2e-6, rel=1e-6)
