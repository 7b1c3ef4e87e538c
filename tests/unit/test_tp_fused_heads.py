"""A fused ``[q; k; v]`` whose parts are sized by head counts (LitGPT's ``attn.qkv``) is planned split by heads, its
output projection with it; what cannot be split so is left whole or refused by name. The table is which LitGPT
structure gets which rule; values under tp are checked on real ranks by tests/distributed/test_tp_packed_heads.py
and the LitGPT parity launch."""

from __future__ import annotations

import ast
import logging
import math

import pytest
import torch
from torch import nn

from lightning_nd.model.structure import read_model_facts
from lightning_nd.tensor_parallel.apply.packed_heads import localize_head_counts
from lightning_nd.tensor_parallel.infer.checks import tp_split
from lightning_nd.tensor_parallel.infer.forward_source import splits_in_three
from lightning_nd.tensor_parallel.infer.fused_heads import head_layout
from lightning_nd.tensor_parallel.infer.resolve import resolve_tp_plan

pytest.importorskip("litgpt")

SPLIT = {"qkv": "packed_heads", "proj": "rowwise_packed_heads"}
ATTENTION = {
    # tiny config of tests/distributed/litgpt_models.py -> the styles of its first block's attention at tp=2
    "llama3": SPLIT,                  # grouped-query: 4 heads, 2 key/value heads
    "mixtral": SPLIT,
    "gemma2": SPLIT,                  # softcapping, sliding windows: in the forward, on the local heads
    "phi2": SPLIT,                    # multi-head, biases, partial rope
    "pythia": SPLIT,
    "qwen2.5": SPLIT,                 # the fused layer's bias, split with its parts
    "stablelm": SPLIT,
    "qwen3_moe": {**SPLIT, "norm_q": "replicated_with_grad_allreduce",  # one head's width: every rank's heads
                  "norm_k": "replicated_with_grad_allreduce"},
    "olmo2": {},                      # norm_q over all heads' queries: left whole
    "latent": {},                     # latent attention: no fused [q; k; v], left whole
}


def _model(key: str) -> nn.Module:
    from tests.distributed.litgpt_models import build_litgpt

    with torch.device("meta"):
        return build_litgpt(key)


def _plan(model: nn.Module, explicit=None, tp: int = 2, sequence_parallel: bool = False):
    return resolve_tp_plan(model, explicit, tp=tp, facts=read_model_facts(model), sequence_parallel=sequence_parallel)


@pytest.mark.parametrize("key", list(ATTENTION))
def test_litgpt_attention_is_split_by_heads_or_left_whole(key):
    entries = _plan(_model(key)).entries
    prefix = "transformer.h.1.attn."
    assert {name.removeprefix(prefix): style for name, style in entries.items() if name.startswith(prefix)} == \
        ATTENTION[key]


def test_a_norm_over_all_heads_leaves_the_attention_whole_by_name(caplog):
    with caplog.at_level(logging.WARNING, logger="lightning_nd.tensor_parallel.infer.resolve"):
        _plan(_model("olmo2"))
    assert "`transformer.h.0.attn.norm_q` normalizes the features `transformer.h.0.attn` splits" in caplog.text


def test_multi_query_attention_is_refused_with_a_plan_that_keeps_it_whole():
    model = _model("falcon")
    with pytest.raises(ValueError, match=r"does not divide `transformer.h.0.attn.config.n_query_groups=1`.*HINT: choose"
                                         r" tp from \[1\], or keep the attention whole") as refusal:
        _plan(model)
    plan = ast.literal_eval(str(refusal.value).rsplit("tp_plan=", 1)[1].removesuffix(")`."))  # the HINT's, copied
    assert _plan(model, plan).entries["transformer.h.3.mlp.fc"] == "colwise"


def test_the_local_counts_go_on_a_copy_of_the_shared_config():
    model = _model("llama3")
    attention = model.transformer.h[0].attn
    localize_head_counts(attention, head_layout(attention), tp=2)
    assert (attention.config.n_head, attention.config.n_query_groups) == (2, 2)  # keys and values one per head
    assert (model.config.n_head, model.config.n_query_groups) == (4, 2)
    assert model.transformer.h[1].attn.config is model.config


def test_the_fused_weight_is_held_part_by_part_and_the_dry_run_halves_llama_3_8b():
    from litgpt.config import Config
    from litgpt.model import GPT

    from lightning_nd.planner.dry_run import plan_for, read_layout_arguments

    with torch.device("meta"):
        model = GPT(Config.from_name("Llama-3-8B"))
    layout = plan_for(read_layout_arguments({"tp": 2}), 2, model)
    held = sum(math.prod(shard.local_shape) for shard in layout.rank(0).params)
    assert held / sum(param.numel() for param in model.parameters()) <= 0.51
    attention = model.transformer.h[0].attn
    assert tp_split(attention.qkv, "weight", "packed_heads") == (0, 3)
    assert tp_split(attention.qkv, "bias", "packed_heads") is None  # a fused bias is held whole (as packed_qkv's)


class FusedAttention(nn.Module):
    """Another codebase's attention: counts on the module itself, a fused layer of other names."""

    def __init__(self, width: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, width // heads
        self.wqkv = nn.Linear(width, (heads + 2 * kv_heads) * self.head_dim)
        self.out = nn.Linear(heads * self.head_dim, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query, _key, _value = self.wqkv(x).split([self.num_heads * self.head_dim,
                                                  self.num_key_value_heads * self.head_dim,
                                                  self.num_key_value_heads * self.head_dim], dim=-1)
        return self.out(query)


class HeadMajorAttention(FusedAttention):
    """The same weights read another way: ``[q; k; v]`` interleaved per key/value head, which the part by part split
    would cut across."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.wqkv(x).view(*x.shape[:2], self.num_key_value_heads, -1, self.head_dim)
        return self.out(mixed[..., :-2, :].flatten(2))


class GroupedSplitAttention(FusedAttention):
    """LitGPT 0.4's layout: the fused output named, then rebound to a view grouped by key/value head, and only then
    split in three, on the group's dim. Not ``[q; k; v]``: the part by part split would read the wrong rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.wqkv(x)
        per_kv = self.num_heads // self.num_key_value_heads
        qkv = qkv.view(*x.shape[:2], self.num_key_value_heads, per_kv + 2, self.head_dim)
        query, _key, _value = qkv.split((per_kv, 1, 1), dim=3)
        return self.out(query.flatten(2))


class Stack(nn.Module):
    """Blocks of the attention above and an MLP of known names."""

    def __init__(self, head_major: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"attention": (HeadMajorAttention if head_major else FusedAttention)(),
                                                   "fc1": nn.Linear(32, 64), "fc2": nn.Linear(64, 32)})
                                    for _ in range(2))


@pytest.mark.parametrize("head_major", [False, True])
def test_a_fused_layer_is_split_only_where_the_forward_splits_it_in_three(head_major):
    model = Stack(head_major)
    attention = model.layers[0]["attention"]
    assert splits_in_three(attention, "wqkv") is not head_major
    assert not splits_in_three(GroupedSplitAttention(), "wqkv")
    assert GroupedSplitAttention()(torch.randn(2, 3, 32)).shape == (2, 3, 32)
    assert head_layout(attention).attrs == ("num_heads", "num_key_value_heads")
    entries = _plan(model).entries
    split = {"layers.1.attention.wqkv": "packed_heads", "layers.1.attention.out": "rowwise_packed_heads"}
    assert {name: style for name, style in entries.items() if name.startswith("layers.1.attention")} == \
        ({} if head_major else split)
    assert entries["layers.1.fc1"] == "colwise"


def test_an_explicit_plan_naming_it_on_a_module_without_head_counts_is_refused():
    model = Stack(head_major=False)
    for attention in (layer["attention"] for layer in model.layers):
        del attention.num_heads
    with pytest.raises(ValueError, match=r"`layers.0.attention.wqkv` is packed_heads, but `layers.0.attention` names no"
                                         r" head counts"):
        _plan(model, {"layers.*.attention.wqkv": "packed_heads", "layers.*.attention.out": "rowwise_packed_heads"})
