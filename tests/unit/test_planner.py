"""The planner and the cost of one layout (`python -m lightning_nd.plan`), end to end, without a process group:
its ranking, its JSON, and for a 70B Llama on 64 GPUs the arithmetic of the tp=8, pp=4, dp_shard=2 row."""

from __future__ import annotations

import json
import math

import torch

from lightning_nd.cost.model_state import model_state
from lightning_nd.layout.record import Layout
from lightning_nd.planner.__main__ import main
from tests.unit.test_dry_run import LLAMA_70B

SMALL = ["--model", "examples.models.llama:Llama", "--devices", "8", "--gpus-per-node", "4", "--seq-len", "64",
         "--global-batch", "16"]
LLAMA_70B_ARGS = ["--hf-model-type", "llama", "--hf-kwargs", json.dumps(LLAMA_70B), "--devices", "64",
                  "--gpus-per-node", "8"]
KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "peak_bytes")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_planner_ranks_fitting_layouts_first_by_step_time(capsys):
    started = torch.distributed.is_initialized()  # (another test may have left one; the planner starts none)
    code, out, err = _run(capsys, *SMALL, "--gpu-memory", "1MB", "--json")
    assert code == 0, err
    layouts = json.loads(out)["layouts"]
    fits = [entry["fits"] for entry in layouts]
    assert any(fits) and not all(fits) and fits == sorted(fits, reverse=True), fits
    fitting = [entry["cost"]["step_time"]["total_s"] for entry in layouts if entry["fits"]]
    assert fitting == sorted(fitting)
    assert all(entry["cost"]["peak_bytes"] > 1_000_000 for entry in layouts if not entry["fits"])
    assert layouts[0]["why"] == "fastest layout that fits" and "does not fit" in layouts[-1]["why"]
    for entry in layouts:
        for rank in entry["cost"]["ranks"]:
            assert all(isinstance(rank[key], int) and rank[key] >= 0 for key in KEYS)
        assert all(isinstance(value, int) for value in entry["cost"]["comm_bytes"].values())
    assert torch.distributed.is_initialized() == started


def test_the_planner_table_says_why_and_how_much(capsys):
    code, out, _ = _run(capsys, *SMALL, "--gpu-memory", "1MB", "--top", "50", "--explain", "tp=2,dp_shard=4")
    assert code == 0
    assert "| 1 |" in out and "fastest layout that fits" in out and "step time vs #1, mostly" in out
    assert "does not fit even with full recomputation" in out
    assert "`tp=2,dp_shard=4` ranks #" in out and "Model state of rank" in out


def test_each_layout_says_the_longest_sequence_it_fits_and_one_step_longer_does_not(capsys):
    from examples.models.llama import Llama, LlamaConfig
    from lightning_nd.cost.memory import rank_memories
    from lightning_nd.cost.shape import Workload, model_shape
    from lightning_nd.planner.dry_run import dry_run
    from lightning_nd.planner.search import longest_sequence
    from lightning_nd.planner.source import Holder

    code, out, _ = _run(capsys, *SMALL, "--gpu-memory", "2MB", "--json")
    assert code == 0
    layouts = json.loads(out)["layouts"]
    assert all(entry["longest_seq"] >= 64 for entry in layouts if entry["fits"])
    assert all(entry["longest_seq"] < 64 for entry in layouts if not entry["fits"])
    with torch.device("meta"):
        model = Holder(Llama(LlamaConfig()))
    shape, workload, memory = model_shape(model.model), Workload(seq_len=64, batch=2), 3 * 2**20
    found = {}
    for sizes, step in (({"dp_shard": 4}, 1), ({"cp": 2, "dp_shard": 2}, 4), ({"cp": 4}, 8),
                        ({"tp": 2, "dp_shard": 2}, 2)):
        layout = dry_run(model, 4, sizes, {"sequence_parallel": "tp" in sizes})

        def peak(seq: int) -> int:
            return max(m.peak_bytes for m in rank_memories(layout, shape, Workload(seq_len=seq, batch=2)))

        longest = found[str(sizes)] = longest_sequence(layout, shape, workload, memory)
        assert longest % step == 0 and peak(longest) <= memory < peak(longest + step), (sizes, longest)
    assert found[str({"cp": 4})] > 2 * found[str({"dp_shard": 4})]  # cp splits the activations of the sequence


def test_bad_planner_input_names_the_fix(capsys):
    code, _, err = _run(capsys, *SMALL[:6], "--gpu-memory", "80GB")
    assert code == 2 and "HINT: add `--seq-len 4096 --global-batch 512`" in err
    code, _, err = _run(capsys, *SMALL, "--gpu-memory", "80 gigs")
    assert code == 2 and "HINT" in err
    code, _, err = _run(capsys, "--params", "7e9", "--devices", "8", "--layout", "tp=2")
    assert code == 2 and "HINT: drop `--layout`" in err


def test_params_only_is_model_state_and_says_so(capsys):
    code, out, _ = _run(capsys, "--params", "7.5e9", "--devices", "64", "--gpus-per-node", "8", "--gpu-memory", "80GB")
    assert code == 0 and "judged on model state alone" in out
    assert "| `dp_shard=64` | 0.117B | 1.75 GiB | 1.75 GiB | yes |" in out  # 16 B x 7.5e9 / 64 = 1.875e9 bytes
    code, out, _ = _run(capsys, "--params", "700e9", "--devices", "8", "--gpu-memory", "80GB")
    assert code == 1 and "| no |" in out and "| yes |" not in out


def test_70b_tp8_pp4_dp2_arithmetic(capsys):
    argv = [*LLAMA_70B_ARGS, "--layout", "tp=8,pp=4,dp_shard=2", "--seq-len", "4096", "--micro-batch", "256",
            "--precision", "bf16-mixed", "--options", '{"pp_microbatches": 256}']
    code, out, err = _run(capsys, *argv, "--json")
    assert code == 0, err
    document = json.loads(out)
    layout = Layout.from_dict({k: v for k, v in document.items() if k != "cost"})
    for rank in (0, 17, 63):  # the embedding's stage, a middle one, the head's
        holding, priced = layout.rank(rank), document["cost"]["ranks"][rank]
        state = model_state(layout, rank)
        assert priced["params_bytes"] == priced["grads_bytes"] == holding.param_bytes  # fp32 shards, as FSDP2 holds
        assert priced["optimizer_bytes"] == 2 * holding.param_bytes + 4 * len(holding.params) == state.optimizer_bytes
    # 70.55B / (tp 8 x pp 4) = 2.2B per model shard; FSDP halves it: ~1.1B fp32 parameters on a rank, not 70B.
    assert 1.05e9 < document["cost"]["ranks"][0]["params_bytes"] / 4 < 1.15e9
    code, out, _ = _run(capsys, *argv)
    assert code == 0
    assert "it holds 1/(tp x pp) = 1/32 of the 70.55B parameters, 2.205B" in out
    assert "optimizer state 8.06 GiB" in out and "P_os+g over 2): 18.48 GiB of model state, 12.32 GiB of it" in out
    assert "not \"71B x 4 bytes / 2 = 131.42 GiB of optimizer state per GPU\"" in out


def test_the_70b_planner_on_64_gpus(capsys):
    """The planner over every layout of a 70B Llama on 8 nodes of 8 x 80 GB (about half a minute)."""
    code, out, err = _run(capsys, *LLAMA_70B_ARGS, "--gpu-memory", "80GB", "--seq-len", "4096", "--global-batch",
                          "512", "--top", "200", "--explain", "tp=8,pp=4,dp_shard=2")
    assert code == 0, err
    assert out.splitlines()[0].endswith("adamw, priced by the h100 datasheet preset")  # a cluster it cannot measure
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    fits = [" | yes | " in row for row in rows]
    assert len(rows) > 40 and any(fits) and fits == sorted(fits, reverse=True)
    assert "`tp=8,pp=4,dp_shard=2` ranks #" in out
    explained = out[out.index("`tp=8,pp=4,dp_shard=2` ranks #"):]
    assert "1/32 of the 70.55B parameters, 2.205B" in explained and "optimizer state 8.06 GiB" in explained
    assert "12.32 GiB of it optimizer state" in explained


def test_a_given_layout_takes_the_global_batch_and_the_gpu_memory_as_the_ranking_does(capsys):
    layout = ["--layout", "tp=2,pp=2,dp_shard=2"]
    code, out, err = _run(capsys, *SMALL, *layout, "--json")  # 16 samples over dp=2: 8 per rank, 8 microbatches
    assert code == 0, err
    planned = json.loads(out)
    assert planned["options"]["pp_microbatches"] == 8 and planned["options"]["precision"] == "32-true"
    ranked = json.loads(_run(capsys, *SMALL, "--gpu-memory", "1GB", "--json")[1])["layouts"]
    [same] = [entry for entry in ranked if (entry["sizes"]["tp"], entry["sizes"]["pp"], entry["sizes"]["dp_shard"])
              == (2, 2, 2) and entry["sizes"]["dp_replicate"] == 1 and entry["sizes"]["cp"] == 1]
    code, out, err = _run(capsys, *SMALL, *layout, "--gpu-memory", "1GB", "--json", "--options",
                          json.dumps({"activation_checkpointing": same["options"]["activation_checkpointing"],
                                      "sequence_parallel": True}))  # the ranking's default under tp
    priced = json.loads(out)
    assert code == 0 and priced["cost"]["fits"] and priced["options"]["precision"] == "bf16-mixed"
    assert priced["cost"]["peak_bytes"] == same["cost"]["peak_bytes"]  # the ranking's price of the same layout
    code, out, _ = _run(capsys, *SMALL, *layout, "--gpu-memory", "500KB")
    assert code == 1 and "does not fit in 488.28 KiB per GPU, for batches of 8 x 64 tokens" in out, out
    code, _, err = _run(capsys, *SMALL[:-1], "15", *layout)
    assert code == 2 and "global batch 15 does not split over dp=2" in err and "HINT" in err, err


def test_parameters_are_priced_as_the_trainers_precision_keeps_them(capsys):
    """A config stored in bfloat16 trained under bf16-mixed keeps fp32 master weights: 16 bytes of model state per
    parameter with AdamW (4 + 4 + 2 x 4), not the config dtype's 8; under bf16-true, 8."""
    config = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 256, "dtype": "bfloat16"}
    argv = ["--hf-model-type", "llama", "--hf-kwargs", json.dumps(config), "--devices", "2", "--seq-len", "32",
            "--global-batch", "4", "--gpu-memory", "1GB", "--layout", "dp_shard=2"]
    per_param = {}
    for precision in ("bf16-mixed", "bf16-true"):
        code, out, err = _run(capsys, *argv, "--precision", precision, "--json")
        assert code == 0, err
        planned = json.loads(out)
        params = sum(math.prod(p["local_shape"]) for p in planned["ranks"][0]["params"])
        rank = planned["cost"]["ranks"][0]
        per_param[precision] = (rank["params_bytes"] + rank["grads_bytes"] + rank["optimizer_bytes"]) / params
    assert round(per_param["bf16-mixed"]) == 16 and round(per_param["bf16-true"]) == 8, per_param
    code, out, _ = _run(capsys, *argv)
    assert code == 0 and ("Parameters priced in float32, as bf16-mixed keeps them (the config's dtype, bfloat16, is"
                          " its checkpoint's storage).") in out, out[:400]
    from lightning_nd.planner.source import storage_line

    built_in_bf16 = torch.nn.Linear(4, 4, dtype=torch.bfloat16, device="meta")  # a factory's own choice
    assert "keeps no fp32 master weights. HINT: build it in float32" in storage_line(built_in_bf16, "bf16-mixed")
