"""The three models every layout is checked on: the example Llama, the unlike-it GPT, and a tiny
randomly initialised Hugging Face Llama with no plan written by us (it declares its own); plus a
Llama whose MLP has one fused ``gate_up_proj`` with a bias (the ``packed_colwise`` style; the bias is held whole
on every tp rank and sharded by FSDP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import Llama, LlamaConfig
from lightning_nd.nn.moe import moe_layers

VOCAB = 256


class FusedSwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inner)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SmallEmbeddingGPT(GPT):
    """GPT-2's embedding init (std 0.02): tied to the head, N(0, 1) rows give logits of ~6 and a loss of ~20, where
    the order of float sums decides the comparison more than the training does. Its constructor calls it, so a
    meta-device build (`configure_model`) runs it again on the shards."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.init_weights()

    def init_weights(self) -> None:
        nn.init.normal_(self.tok.weight, std=0.02)


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name.startswith("litgpt:"):  # a LitGPT model (tests/distributed/litgpt_models.py)
        from tests.distributed.litgpt_models import build_litgpt

        return build_litgpt(name.removeprefix("litgpt:"), seed)
    if name == "fused_llama":
        model = build("llama", seed)
        for layer in model.layers:
            layer.mlp = FusedSwiGLU(64, 128)
        return model
    if name == "llama":
        return Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=8, num_key_value_heads=4))
    if name == "llama8":  # deep enough for 8 pipeline stages (pp=4 x 2 stages per rank)
        return Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                 num_attention_heads=4, num_key_value_heads=2))
    if name == "moe_llama_no_aux":  # the same, its layers' auxiliary losses weighted 0 (see test_expert_parallel.py)
        model = build("moe_llama", seed)
        for layer in moe_layers(model):
            layer.aux_loss_coef = layer.z_loss_coef = 0.0
        return model
    if name == "moe_llama":  # 8 experts, top-2, in both layers
        return Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, num_experts=8))
    if name in ("hf_mixtral", "hf_mixtral_kv4"):  # kv4: as many KV heads as query heads, for tp=4
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=4 if name.endswith("kv4") else 2,
                               num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=64, attn_implementation="sdpa",
                               router_jitter_noise=0.0)
        return MixtralForCausalLM(config)
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, n_embd=48, n_head=4, n_layer=2, block_size=64))
    if name == "gpt4":  # tied embeddings, deep enough for a V-shaped pipeline (pp=2 x 2 stages per rank)
        return SmallEmbeddingGPT(GPTConfig(vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=4, block_size=64))
    if name == "hf_llama":
        from transformers import LlamaConfig as HFLlamaConfig
        from transformers import LlamaForCausalLM

        config = HFLlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                               attn_implementation="sdpa")
        return LlamaForCausalLM(config)
    raise ValueError(f"unknown test model {name!r}")
