"""Models we did not write train like one process: `transformers` families (random init, dropout 0), each in a
plain LightningModule with its own steps, under dp_shard x tp, pp x dp_shard and cp x dp_shard (an MoE family
also under ep x dp_shard x tp, Mixtral with its experts split four ways under tp=4 alone; Llama 4 with its
transposed experts split over tp; Bloom, no declared plan
and no known names, planned from its structure), and PyTorch's own `nn.TransformerEncoder` (its
`nn.MultiheadAttention` split by heads, its feed-forward pair found from the structure) under FSDP, HSDP, tp, pp and
cp, and every LitGPT model of `litgpt_models.py` (`litgpt.model.GPT`, called as LitGPT users call it) under
dp_shard x tp, pp x dp_shard and pp x tp, its MoE models under ep x dp_shard, in one launch of 4 processes. Some
are also built in `configure_model` (``configure_model:<family>``): on the meta device, materialised rank by rank,
then compared from the start they got (that it is plain construction's start: tests/distributed/test_parity.py). Loss
per step, gradients and parameters after 3 SGD-momentum steps match (see families_ranks.py for why not AdamW); a
family/layout pair that is not trained must be refused while planning, for the named reason this file expects."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.family_models import BUILT_LATER, FAMILIES
from tests.distributed.litgpt_models import AVAILABLE as LITGPT_AVAILABLE
from tests.distributed.litgpt_models import LITGPT, LITGPT_REFUSED, MOE_MODELS, PREFIX, PRETRAINING_INIT
from tests.launcher import launch

LAYOUTS = {
    "fsdp2_tp2": {"dp_shard": 2, "tp": 2},
    "pp2_fsdp2": {"pp": 2, "dp_shard": 2},
    "cp2_fsdp2": {"cp": 2, "dp_shard": 2},
    "ep2_fsdp2_tp2": {"dp_shard": 2, "tp": 2, "ep": 2},
    "hsdp": {"dp_replicate": 2, "dp_shard": 2},
    "ddp2_tp2": {"dp_replicate": 2, "dp_shard": 1, "tp": 2},
    "tp4": {"dp_shard": 1, "tp": 4},
    "pp2_tp2": {"pp": 2, "dp_shard": 1, "tp": 2},
    "ep2_fsdp4": {"dp_shard": 4, "ep": 2},
}
BATCH = dict.fromkeys(LAYOUTS, 2) | {"pp2_fsdp2": 4, "pp2_tp2": 4}  # per rank; pp: 2 x pp microbatches of one sample
CHUNK = dict.fromkeys(LAYOUTS, 2) | {"pp2_fsdp2": 1, "pp2_tp2": 1}  # samples per forward on a rank
OPTIONS: dict[str, dict] = {}
REFUSED = {("torch_transformer", "cp2_fsdp2"): "takes no `position_ids`",
           ("torch_transformer", "pp2_fsdp2"): "indexes its first layer",
           ("gpt_oss", "cp2_fsdp2"): "uses attn_implementation='eager'",
           ("bloom", "cp2_fsdp2"): "has no SDPA path in `transformers`",
           ("llama4_text", "cp2_fsdp2"): "attends within a window of 8192 tokens"}
"""(family, layout) -> a phrase its refusal must contain: learned positions from the local length under cp;
`nn.TransformerEncoder`'s forward reads ``self.layers[0]``, which a later stage does not hold; gpt-oss
has no SDPA path (its attention sinks), which ring attention replaces."""
CASES = [(family, layout) for family in FAMILIES for layout in ("fsdp2_tp2", "pp2_fsdp2", "cp2_fsdp2")]
if LITGPT_AVAILABLE:  # tests/unit/test_litgpt_install.py fails when litgpt is missing, so these cannot silently go
    CASES += [(PREFIX + key, layout) for key in LITGPT for layout in ("fsdp2_tp2", "pp2_fsdp2", "pp2_tp2")]
    CASES += [(PREFIX + key, "ep2_fsdp4") for key in MOE_MODELS] + [(PREFIX + "llama3", "cp2_fsdp2")]
    REFUSED |= LITGPT_REFUSED
    # built in `configure_model` (on the meta device, materialised rank by rank), trained from the start it got
    CASES += [(BUILT_LATER + PREFIX + key, layout) for key, layout in (
        ("llama3", "fsdp2_tp2"), ("gemma2", "pp2_tp2"), ("pythia", "pp2_fsdp2"), ("shared_grouped_moe", "ep2_fsdp4"),
        ("llama3" + PRETRAINING_INIT, "fsdp2_tp2"))]
CASES += [(BUILT_LATER + "qwen3_moe", "ep2_fsdp2_tp2"), ("mixtral", "tp4"), ("qwen3_moe", "ep2_fsdp2_tp2"), ("gpt2", "ddp2_tp2"), ("torch_transformer", "fsdp2_tp2"), ("torch_transformer", "hsdp"),
          ("torch_transformer", "pp2_fsdp2"), ("torch_transformer", "cp2_fsdp2")]


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return launch("tests.distributed.families_ranks:run", 4, tmp_path_factory.mktemp("families"), timeout=1200,
                  cases=CASES, layouts=LAYOUTS, batch=BATCH, chunk=CHUNK, options=OPTIONS)


@pytest.mark.parametrize("family, layout", CASES)
def test_family_trains_like_one_process_or_is_refused_by_name(per_rank, family, layout):
    first = per_rank[0][(family, layout)]
    if (family, layout) in REFUSED:
        assert REFUSED[(family, layout)] in first["parallel"].get("refused", ""), first["parallel"]
        return
    assert "refused" not in first["parallel"], first["parallel"]["refused"]
    reference = first["reference"]
    torch.testing.assert_close(torch.tensor(first["parallel"]["losses"]), torch.tensor(reference["losses"]),
                               rtol=1e-6, atol=2e-6)
    params, grads = {}, {}
    for result in per_rank:
        for name, value in result[(family, layout)]["parallel"]["params"].items():
            canonical = reference["aliases"][name]  # a tied weight's copy on the last stage has the head's name
            if canonical in params:
                torch.testing.assert_close(value, params[canonical], rtol=0, atol=0, msg=lambda m: f"copies of {name}: {m}")
            params[canonical] = value
            grads[canonical] = result[(family, layout)]["parallel"]["grads"][name]
    assert params.keys() == reference["params"].keys()
    for name, expected in reference["grads"].items():
        torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=2e-6, msg=lambda m: f"grad {name}: {m}")
    for name, expected in reference["params"].items():
        torch.testing.assert_close(params[name], expected, rtol=1e-4, atol=5e-5, msg=lambda m: f"param {name}: {m}")
