"""Tiny random-init `transformers` models of many families, each a zero-change LightningModule (its own steps,
the model called as its model card says), for the family parity launch (tests/distributed/test_families.py)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from tests.distributed.litgpt_models import PREFIX, build_litgpt
from tests.models import VOCAB

COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "bos_token_id": 0, "eos_token_id": 0}
NO_DROPOUT = {"attention_dropout": 0.0, "hidden_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
              "attn_pdrop": 0.0, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "summary_first_dropout": 0.0}
# family -> (config class, model class, config fields beyond COMMON)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 64}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"pad_token_id": 0}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"num_key_value_heads": None, "rotary_pct": 0.5}),
    # experts stored transposed ([E, H, 2I]) that see every token: split over tp by transposed_experts; layer 0 dense
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM", {
        "head_dim": 16, "intermediate_size": 32, "intermediate_size_mlp": 96, "num_local_experts": 4,
        "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "router_aux_loss_coef": 0.0}),
    # no declared plan, no known names: planned from its structure; ALiBi biases cut to each rank's heads
    "bloom": ("BloomConfig", "BloomForCausalLM", {"n_head": 4, "n_layer": 2, "attn_implementation": "eager"}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                             "moe_intermediate_size": 32, "head_dim": 16,
                                                             "router_aux_loss_coef": 0.0}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                         "num_key_value_heads": 4, "router_aux_loss_coef": 0.0,
                                                         "sliding_window": None}),
    # multi-head latent attention (q and kv latents), a dense first block, routed experts split over tp by ETP
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "num_key_value_heads": 4, "head_dim": 8, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1}),
    # attention sinks split with their heads; its experts (clamped SwiGLU, biases) whole on every tp rank
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"head_dim": 16, "num_local_experts": 4,
                                                       "num_experts_per_tok": 2, "router_aux_loss_coef": 0.0,
                                                       "sliding_window": 8, "attn_implementation": "eager"}),
}


@dataclass
class Output:
    logits: torch.Tensor


class TorchTransformerLM(nn.Module):
    """A causal LM on PyTorch's own `nn.TransformerEncoder` (fused `nn.MultiheadAttention`), learned positions."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 64, heads: int = 4, layers: int = 2, length: int = 64) -> None:
        super().__init__()
        self.embed, self.positions = nn.Embedding(vocab, hidden), nn.Embedding(length, hidden)
        layer = nn.TransformerEncoderLayer(hidden, heads, 2 * hidden, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.lm_head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> Output:
        length = input_ids.shape[1]
        hidden = self.embed(input_ids) + self.positions(torch.arange(length, device=input_ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=input_ids.device)
        return Output(self.lm_head(self.norm(self.encoder(hidden, mask=mask, is_causal=True))))



def build_family(name: str, seed: int | None = 0) -> nn.Module:
    """``seed``: None draws from the random state as it is (a model built in `configure_model`, seeded by the run)."""
    if name == "torch_transformer":
        if seed is not None:
            torch.manual_seed(seed)
        return TorchTransformerLM()
    config_name, model_name, extra = FAMILIES[name]
    transformers = importlib.import_module("transformers")
    config_cls = getattr(transformers, config_name)
    fields = {**COMMON, **extra}
    known = config_cls().to_dict()
    fields |= {key: value for key, value in NO_DROPOUT.items() if key in known}
    fields = {key: value for key, value in fields.items() if value is not None or key in known}
    attention = fields.pop("attn_implementation", "sdpa")  # gpt-oss has no SDPA path (its sinks)
    config = config_cls(**{key: value for key, value in fields.items() if key in known or key in extra},
                        attn_implementation=attention)
    if seed is not None:
        torch.manual_seed(seed)
    return getattr(transformers, model_name)(config)


class FamilyLM(LightningModule):
    """What a user writes around a model they did not write: the logits against labels already aligned to them."""

    def __init__(self, model: nn.Module, lr: float = 0.05) -> None:
        super().__init__()
        self.model, self.lr = model, lr

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.model(input_ids=batch["tokens"]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class LitGPTLM(FamilyLM):
    """What a LitGPT user writes: the model called on the tokens (it returns the logits)."""

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.model(batch["tokens"])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())


BUILT_LATER = "configure_model:"
"""Family names of a model the LightningModule builds in `configure_model` (on the meta device, materialised rank by
rank): ``configure_model:<family>``."""


class BuildsInConfigureModel:
    """The model built in `configure_model`, once (Lightning's advice: the hook may be called again)."""

    model: nn.Module | None
    build: Callable[[], nn.Module]

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.build()


class LaterFamilyLM(BuildsInConfigureModel, FamilyLM):
    def __init__(self, build: Callable[[], nn.Module], lr: float = 0.05) -> None:
        super().__init__(None, lr=lr)
        self.build = build


class LaterLitGPTLM(BuildsInConfigureModel, LitGPTLM):
    def __init__(self, build: Callable[[], nn.Module], lr: float = 0.05) -> None:
        super().__init__(None, lr=lr)
        self.build = build


def family_module(name: str, lr: float = 0.05) -> LightningModule:
    """The LightningModule a user writes around family ``name``: a LitGPT model (``litgpt:<key>``) called on the
    tokens, any other called as its model card says; built in `__init__`, or in `configure_model` for
    ``configure_model:<family>``."""
    if name.startswith(BUILT_LATER):  # seeded by the run, as a user's `configure_model` is
        name = name.removeprefix(BUILT_LATER)
        if name.startswith(PREFIX):
            return LaterLitGPTLM(partial(build_litgpt, name[len(PREFIX):], None), lr=lr)
        return LaterFamilyLM(partial(build_family, name, None), lr=lr)
    if name.startswith(PREFIX):
        return LitGPTLM(build_litgpt(name[len(PREFIX):]), lr=lr)
    return FamilyLM(build_family(name), lr=lr)
