"""A small Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU (or a
mixture of SwiGLU experts with ``num_experts > 0``).

Written the way a user would write it, with nothing parallel in it; `NDParallel` finds its blocks
(``layers``) and its projections (``q_proj`` ... ``down_proj``) by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    rope_theta: float = 10000.0
    num_experts: int = 0
    """> 0: every MLP is a mixture of this many experts (`lightning_nd.nn.moe.MoE`, SwiGLU experts)."""
    num_experts_per_tok: int = 2
    moe_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss of every MoE layer (`MoE(aux_loss_coef=...)`)."""
    moe_z_loss_coef: float = 0.0
    """Weight of the router z-loss (`MoE(z_loss_coef=...)`)."""
    moe_capacity_factor: float | None = None
    """Each expert takes at most this multiple of its even share of a batch's assignments; the rest is dropped."""
    moe_random_routing_steps: int = 0
    """Route at random for this many first training steps, annealed linearly to the learned router."""
    moe_bias_update_rate: float = 0.0
    """> 0: the loss-free balancing bias, moved by this much against each expert's load after every optimizer step
    (`NDParallel` applies it; `MoE.update_bias`)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate(x: torch.Tensor, theta: float, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` [batch, seq, heads, head_dim] at ``positions`` [seq]."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim)
    angles = torch.outer(positions.to(x.device, torch.float32), inv_freq)
    cos, sin = angles.cos()[None, :, None, :].to(x.dtype), angles.sin()[None, :, None, :].to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.theta = config.rope_theta
        kv_dim = config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[:2]
        q = rotate(self.q_proj(x).view(batch, seq, -1, self.head_dim), self.theta, positions).transpose(1, 2)
        k = rotate(self.k_proj(x).view(batch, seq, -1, self.head_dim), self.theta, positions).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size)
        self.self_attn = Attention(config)
        self.post_attention_norm = RMSNorm(config.hidden_size)
        if config.num_experts:
            from lightning_nd.nn.moe import MoE

            self.mlp = MoE(config.hidden_size, config.intermediate_size, config.num_experts, config.num_experts_per_tok,
                           aux_loss_coef=config.moe_aux_loss_coef, z_loss_coef=config.moe_z_loss_coef,
                           capacity_factor=config.moe_capacity_factor,
                           random_routing_steps=config.moe_random_routing_steps,
                           bias_update_rate=config.moe_bias_update_rate)
        else:
            self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_norm(x), positions)
        return x + self.mlp(self.post_attention_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig | None = None) -> None:
        super().__init__()
        config = config or LlamaConfig()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` [batch, seq] (rows alike): where each token sits; 0..seq-1 when not given."""
        positions = torch.arange(tokens.shape[1], device=tokens.device) if position_ids is None else position_ids[0]
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, positions)
        return self.lm_head(self.norm(x))
