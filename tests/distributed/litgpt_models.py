"""Tiny LitGPT models (`litgpt.model.GPT`, one plain `nn.Module` per config), each trained in the LightningModule a
LitGPT user writes (`self.model(idx)`: `family_models.LitGPTLM`), for the family parity launch
(tests/distributed/test_families.py) and the LitGPT tests. One instance per distinct combination of attention, MLP and norm classes in `litgpt.config.configs`, the
named configs the issue lists, a multi-query one, and two hand-made configs no named config of litgpt 0.5.13 uses:
shared experts with grouped routing, and latent attention.

Every config is shrunk the same way: 4 layers, width 48, 4 heads in 2 query groups (multi-query keeps 1), the
vocabulary of the suite's token data, no dropout (LitGPT has none). Each model is built under a fixed seed and
initialised with the model's own `_init_weights` where its constructor leaves a parameter empty
(`GroupedTopkRouter.weight` is `torch.empty` with no `reset_parameters`).
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import torch
from torch import nn

from tests.models import VOCAB

PREFIX = "litgpt:"
"""Family names of LitGPT models in the family launch: ``litgpt:<key of LITGPT>``."""
AVAILABLE = importlib.util.find_spec("litgpt") is not None
SHRINK = {"n_layer": 4, "n_embd": 48, "n_head": 4, "n_query_groups": 2, "head_size": 12, "vocab_size": VOCAB,
          "padded_vocab_size": VOCAB, "block_size": 64, "intermediate_size": 96}
MOE = {"n_expert": 4, "n_expert_per_token": 2, "moe_intermediate_size": 32}

LITGPT: dict[str, tuple[str | None, dict]] = {
    # (named config to start from, or None for a hand-made `Config`; fields replaced after SHRINK)
    "llama3": ("Llama-3.2-1B", {}),                                     # LLaMAMLP, RMSNorm, GQA
    "mixtral": ("Mixtral-8x7B-v0.1", MOE),                              # LLaMAMoE: gate Linear + ModuleList
    "gemma2": ("Gemma-2-2b", {"sliding_window_size": 8}),               # GemmaMLP, softcapping, sliding windows
    "phi2": ("phi-2", {"n_query_groups": 4}),                           # parallel residual, shared norm, biases
    "pythia": ("pythia-14m", {"n_query_groups": 4}),                    # GptNeoxMLP, LayerNorm, partial rope
    "qwen2.5": ("Qwen2.5-0.5B", {}),                                    # attention biases
    "stablelm": ("stablelm-3b-4e1t", {"n_query_groups": 4}),            # LLaMAMLP with LayerNorm
    "falcon": ("falcon-7b", {"n_query_groups": 1}),                     # multi-query: one key/value head
    "qwen3_moe": ("Qwen3-30B-A3B", MOE),                                # LLaMAMoE with per-head q/k norms
    "olmo2": ("OLMo-2-1124-7B", {"n_query_groups": 4}),                 # q/k norms over all heads' width
    "shared_grouped_moe": (None, {**MOE, "name": "shared_grouped_moe", "mlp_class_name": "LLaMAMoE",
                                  "norm_class_name": "RMSNorm", "n_shared_expert": 1, "n_expert_groups": 2,
                                  "n_topk_groups": 1, "n_topk_scores_per_group": 2, "norm_topk_prob": True,
                                  "routed_scaling_factor": 2.5, "first_k_dense_replace": 1}),
    "latent": (None, {"name": "latent", "mlp_class_name": "LLaMAMLP", "norm_class_name": "RMSNorm", "n_query_groups": 4,
                      "latent_attention": {"q_lora_rank": 32, "kv_lora_rank": 24, "qk_rope_head_dim": 8,
                                           "qk_nope_head_dim": 8, "v_head_dim": 12}}),
}
MOE_MODELS = ("mixtral", "qwen3_moe", "shared_grouped_moe")
LITGPT_REFUSED = {
    (PREFIX + "llama3", "cp2_fsdp2"): "takes no `position_ids`",
    (PREFIX + "falcon", "fsdp2_tp2"): "n_query_groups=1`",
    (PREFIX + "falcon", "pp2_tp2"): "n_query_groups=1`",
}
"""(family, layout) -> a phrase its refusal names: LitGPT's forward takes its positions from the input's length (its
rope cache sliced ``[:T]``), which under cp is the shard's; multi-query attention's one key/value head is not split
over tp (the refusal gives the plan that keeps the attention whole); docs/pages/models-outside-transformers.md."""


def litgpt_config(key: str):
    from litgpt.config import Config

    name, extra = LITGPT[key]
    fields = {**SHRINK, **extra}
    if name is None:
        return Config(**fields)
    return Config.from_name(name, **fields)


PRETRAINING_INIT = "/pretraining_init"
"""A key's suffix: the model initialised as LitGPT's pretraining script does (`litgpt.pretrain.initialize_weights`:
every `Linear` and `Embedding` given a ``reset_parameters`` of its own, a normal of GPT-NeoX's widths, then all run)."""


def build_litgpt(key: str, seed: int | None = 0) -> nn.Module:
    """``seed``: None draws from the random state as it is (a model built in `configure_model`, seeded by the run)."""
    from litgpt.model import GPT

    if seed is not None:
        torch.manual_seed(seed)
    config = litgpt_config(key.removesuffix(PRETRAINING_INIT))
    model = GPT(config)
    if any(type(module).__name__ == "GroupedTopkRouter" for module in model.modules()):
        model.apply(model._init_weights)
    if key.endswith(PRETRAINING_INIT):
        from litgpt.pretrain import initialize_weights

        initialize_weights(SimpleNamespace(strategy=None), model, n_layer=config.n_layer, n_embd=config.n_embd)
    return model
