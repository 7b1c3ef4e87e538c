"""Tiny random configs of any transformers family, and the family's causal LM (else its base model) built from one
(tests/distributed/hf_families_ranks.py)."""

from __future__ import annotations

import importlib

import torch
import transformers
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 64,
        "moe_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "shared_expert_intermediate_size": 32, "n_layer": 2, "n_embd": 64, "n_head": 4,
        "n_positions": 64, "rotary_dim": 8, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
        "attention_dropout": 0.0, "hidden_dropout": 0.0,
        # multi-head latent attention (DeepSeek-V2 and its kin): per-head q/k width 8 + 8 = head_dim, low-rank q and kv
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 32, "q_lora_rank": 48,
        "n_group": 1, "topk_group": 1,
        "keep_window_size": 4}  # Doge masks keys dynamically (its per-head `dt_proj`) only beyond this many


def tiny_model(model_type: str) -> torch.nn.Module:
    """The family's causal LM (else its base model) from a small config, on fake tensors (callers' mode)."""
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class()
    sizes = dict(TINY)
    if hasattr(defaults, "kv_lora_rank"):  # MLA: its rotary embedding is `head_dim` wide, every head has its key
        sizes.update(head_dim=TINY["qk_rope_head_dim"], num_key_value_heads=TINY["num_attention_heads"])
    config = config_class(**{key: value for key, value in sizes.items() if hasattr(defaults, key)})
    # Nested configs (vision, audio, and a text model the top config does not forward to) keep their full default
    # size otherwise: muse_glimmer's text model had 52 layers of width 6656, 23 s of fake-tensor forward and backward.
    for sub in vars(config).values():
        if isinstance(sub, transformers.PretrainedConfig):
            for key, value in sizes.items():
                if hasattr(sub, key):
                    setattr(sub, key, value)
    config.dtype, config.use_cache = torch.float32, False
    config._experts_implementation = "eager"  # grouped_mm has no float32 kernel on fake tensors
    for names in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, modeling_auto.MODEL_MAPPING_NAMES):
        if model_type in names:
            module = importlib.import_module(config_class.__module__.replace(".configuration_", ".modeling_"))
            model_class = getattr(module, names[model_type], None)
            if model_class is not None:
                return model_class(config)
    return _model_of_config(config_class)(config)


def _model_of_config(config_class: type) -> type:
    """A sub-model's class (``Qwen3OmniMoeTalkerTextConfig``): the family's model classes that take this config."""
    module = importlib.import_module(config_class.__module__.replace(".configuration_", ".modeling_"))
    classes = [value for value in vars(module).values() if isinstance(value, type)
               and issubclass(value, transformers.PreTrainedModel) and getattr(value, "config_class", None) is config_class]
    classes = [cls for cls in classes if "PreTrained" not in cls.__name__]
    classes.sort(key=lambda cls: (not cls.__name__.endswith("ForCausalLM"), not cls.__name__.endswith("Model")))
    if not classes:
        raise LookupError(f"no model class of {config_class.__name__}")
    return classes[0]
