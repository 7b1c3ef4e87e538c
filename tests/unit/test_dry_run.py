"""`python -m lightning_nd.plan`: the Layout for people and as JSON, no process group, the same errors as a run."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_nd import Layout
from lightning_nd.planner.__main__ import main

LLAMA_70B = {"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
             "intermediate_size": 28672, "vocab_size": 128256}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_dry_run_shows_splits_styles_stages_and_one_rank(capsys):
    code, out, err = _run(capsys, "--model", "examples.models.llama:Llama", "--devices", "8",
                          "--layout", "tp=2,pp=2", "--options", '{"sequence_parallel": true}')
    assert code == 0, err
    assert "| `tp` | 2 | every weight matrix |" in out and "| `dp_shard` | 2 |" in out
    assert "| `model.layers.*.self_attn.q_proj` | colwise | pattern | 4 |" in out
    assert "| `model.norm` | sequence_parallel | sequence_parallel | 1 |" in out
    assert "| 0 | 0 | embed_tokens + layers.0..layers.1 |" in out and "| 1 | 1 | layers.2..layers.3 + norm + lm_head |" in out
    assert "Rank 0 (pp=0" in out and "**total**" in out
    assert not torch.distributed.is_initialized()


def test_json_is_the_layout(capsys):
    code, out, _ = _run(capsys, "--model", "examples.models.llama:Llama", "--devices", "4", "--layout", "tp=2",
                        "--precision", "bf16-mixed", "--json")
    assert code == 0
    layout = Layout.from_json(out)
    assert layout.dims["dp_shard"] == 2 and layout.options.param_dtype == "bfloat16"
    assert json.loads(out)["ranks"][0]["param_bytes"] == layout.rank(0).param_bytes


@pytest.mark.parametrize(("argv", "words"), [
    (["--layout", "tp=3"], ["does not divide world_size=8"]),
    (["--layout", "tpp=2"], ["Unknown parallel dim `tpp`", "did you mean `tp`"]),
    (["--layout", "tp=2", "--options", '{"zero_stag": 2}'], ["no option `zero_stag`", "`zero_stage`"]),
    (["--layout", "cp=2", "--seq-len", "10"], ["cp=2", "sequence length is 10", "multiple of 4"]),
    (["--layout", "tp=2", "--options", '{"sequence_parallel": true}', "--seq-len", "15"],
     ["sequence length 15 does not divide by 2"]),
    (["--layout", "pp=2", "--seq-len", "16", "--micro-batch", "3"], ["3 samples per rank", "pp_microbatches=4"]),
])
def test_a_bad_layout_exits_2_with_the_runs_message(capsys, argv, words):
    code, _, err = _run(capsys, "--model", "examples.models.llama:Llama", "--devices", "8", *argv)
    assert code == 2
    for word in [*words, "HINT"]:
        assert word in err, err
    assert not torch.distributed.is_initialized()


def test_topology_warning_names_the_cheaper_layout(capsys):
    code, out, _ = _run(capsys, "--model", "examples.models.llama:Llama", "--devices", "16", "--layout", "tp=4",
                        "--gpus-per-node", "2")
    assert code == 0
    assert "### Warnings" in out and "`tp=4` makes groups of 4 neighbouring ranks, which span 2 nodes" in out


def test_a_70b_llama_at_64_devices(tmp_path, capsys):
    """The dry run of a 70B-shaped Llama config prints at 64 devices with no process group; each rank holds
    about 1/32 of the parameters (tp=8 x pp=4; dp_shard=2 then halves their storage)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", **LLAMA_70B}))
    code, out, err = _run(capsys, "--hf-config", str(config), "--devices", "64", "--layout", "tp=8,pp=4,dp_shard=2",
                          "--gpus-per-node", "8", "--seq-len", "4096", "--micro-batch", "8", "--json")
    assert code == 0, err
    assert not torch.distributed.is_initialized()
    layout = Layout.from_json(out)
    per_rank = [sum(torch.Size(p.local_shape).numel() for p in holding.params) for holding in layout.ranks]
    total = 70_553_706_496  # Llama-3-70B with untied embeddings
    assert min(per_rank) > total / 32 / 2 * 0.85 and max(per_rank) < total / 32 / 2 * 1.25  # dp_shard=2 halves
    assert layout.ranks[0].params[0].dtype == "float32" and len(layout.roles["tp"][0]) == 8
    assert layout.warnings == ()


GEMMA2 = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128}


def test_a_family_without_sdpa_is_planned_eager_and_refused_under_cp(capsys):
    """Gemma2 has no sdpa attention: the dry run builds it eager (as a run of it would be) instead of failing on
    transformers' error, and context parallelism, which needs sdpa, is refused by name."""
    argv = ("--hf-model-type", "gemma2", "--hf-kwargs", json.dumps(GEMMA2), "--devices", "4", "--layout")
    code, out, err = _run(capsys, *argv, "dp_shard=2,tp=2")
    assert code == 0 and "Gemma2ForCausalLM" in out, err
    code, _, err = _run(capsys, *argv, "cp=2,dp_shard=2")
    assert code == 2 and "attn_implementation='eager'" in err and "cp=1" in err, err


def test_a_config_the_family_rejects_exits_2_naming_it(capsys):
    """Phi3's default pad_token_id (32000) outside a 128-token vocabulary: its embedding asserts; the dry run says
    which family refused which setting (exit 2) instead of a traceback (exit 1)."""
    code, _, err = _run(capsys, "--hf-model-type", "phi3", "--hf-kwargs", json.dumps(GEMMA2), "--devices", "4",
                        "--layout", "tp=2")
    assert code == 2 and "Phi3Config" in err and "Padding_idx" in err and "pad_token_id" in err, err
