"""A small GPT-style model, deliberately unlike `llama.py`: learned positions, LayerNorm with bias,
biased projections named ``wq/wk/wv/wo`` and ``fc1/fc2``, a head count read in ``view``, blocks in an
``nn.Sequential``, and an output head tied to the token embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 256
    n_embd: int = 48
    n_head: int = 4
    n_layer: int = 3
    block_size: int = 64


class SelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.wq = nn.Linear(config.n_embd, config.n_embd)
        # No key bias: softmax ignores a shift shared by all keys, so its gradient is exactly zero
        # in exact arithmetic and pure rounding noise in practice (Adam would amplify it to lr-sized steps).
        self.wk = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.wv = nn.Linear(config.n_embd, config.n_embd)
        self.wo = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (proj(x).view(batch, seq, self.n_head, -1).transpose(1, 2) for proj in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = SelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.fc1 = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.fc2 = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        config = config or GPTConfig()
        self.tok = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.Sequential(*(Block(config) for _ in range(config.n_layer)))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.out = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.out.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device) if position_ids is None else position_ids
        x = self.blocks(self.tok(tokens) + self.pos(positions))
        return self.out(self.ln_f(x))
