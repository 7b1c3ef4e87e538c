"""What the cost model needs to know about a model and a batch: `ModelShape` and `Workload`.

`model_shape` reads a model (real or on the meta device) the way the planner sees it: sizes from its
config or its modules (`layout.structure.read_model_facts`), the vocabulary from its largest embedding, the
MLP's kind from its projections' names. Nothing here allocates memory or imports Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lightning_nd.model.structure import find_blocks, is_experts, read_model_facts

GATED_MLP_NAMES = ("gate_proj", "w3", "gate_up_proj", "up_proj")
PRECISION_BYTES = {"32-true": 4, "64-true": 8, "bf16-mixed": 2, "16-mixed": 2, "bf16-true": 2, "16-true": 2}
TOP_K_ATTRS = ("num_experts_per_tok", "top_k", "moe_top_k")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes: enough to price its activations, FLOPs and communication."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    """The MLP's inner size (one expert's under MoE)."""
    vocab: int
    params: int
    """Every parameter, counted once (a tied embedding/head once)."""
    mlp: Literal["gated", "plain"] = "gated"
    """``gated``: SwiGLU (gate, up, down: Llama, Mixtral); ``plain``: two matmuls around GELU (GPT)."""
    experts: int = 0
    top_k: int = 0
    moe_blocks: tuple[int, ...] | None = None
    """Indices of the blocks that hold experts (None: every block when ``experts``; DeepSeek's first blocks
    are dense)."""
    dense_intermediate: int = 0
    """The inner size of the MLP of the blocks without experts, where some have none (DeepSeek's first blocks;
    0: none, or the same as ``intermediate``)."""

    @property
    def moe_layers(self) -> int:
        return (self.layers if self.moe_blocks is None else len(self.moe_blocks)) if self.experts else 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def expert_params(self) -> int:
        """Parameters of every layer's experts (0 without MoE)."""
        matrices = 3 if self.mlp == "gated" else 2
        return self.moe_layers * self.experts * matrices * self.hidden * self.intermediate

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (MoE: top-k of the experts)."""
        if not self.experts:
            return self.params
        return self.params - self.expert_params + self.expert_params * self.top_k // self.experts


@dataclass(frozen=True)
class Workload:
    """One optimizer step as one batch rank sees it."""

    seq_len: int
    batch: int
    """Samples in one forward/backward on a batch rank (the DataLoader's batch; pp splits it in microbatches)."""
    accumulation: int = 1
    """Forward/backward passes per optimizer step (gradient accumulation)."""
    precision: str = "32-true"
    """The Trainer's precision: sets the activations' element size."""

    @property
    def activation_bytes(self) -> int:
        return PRECISION_BYTES.get(self.precision, 4)


def model_shape(model: Any, block_classes: Any = None) -> ModelShape:
    """The `ModelShape` of ``model`` (any ``nn.Module``; the meta device is fine)."""
    blocks = find_blocks(model, block_classes)
    facts = read_model_facts(model, blocks)
    hidden, heads = facts.hidden_size, facts.num_attention_heads
    embeddings = [m for _, m in model.named_modules() if type(m).__name__ == "Embedding"]
    if hidden is None and embeddings:
        hidden = max(embeddings, key=lambda m: m.num_embeddings).embedding_dim
    if not blocks or hidden is None or heads is None:
        missing = [name for name, value in (("repeated blocks", blocks), ("hidden size", hidden),
                                            ("attention heads", heads)) if not value]
        raise ValueError(f"The cost model cannot read the {', '.join(missing)} of `{type(model).__name__}`."
                         " HINT: give the model an HF-style `config` (hidden_size, num_attention_heads), or pass"
                         " `block_classes=` for its transformer layers.")
    names = [name.rsplit(".", 1)[-1] for name, _ in blocks[0][1].named_parameters()]
    names += [name.rsplit(".", 1)[-1] for name, _ in blocks[0][1].named_modules()]
    gated = any(word in names for word in GATED_MLP_NAMES)
    experts = facts.num_experts or 0
    intermediate = facts.intermediate_size or _intermediate(blocks[0][1], hidden)
    moe_blocks = _moe_blocks(blocks) if experts else None
    dense_intermediate = 0
    if moe_blocks:  # one expert's inner size from its stacks; a dense block's own where there is one
        dense = [block for index, (_, block) in enumerate(blocks) if index not in moe_blocks]
        dense_intermediate = _intermediate(dense[0], hidden) if dense else 0
        intermediate = _intermediate(blocks[moe_blocks[0]][1], hidden)
    return ModelShape(
        hidden=hidden, layers=len(blocks), heads=heads, kv_heads=facts.num_key_value_heads or heads,
        intermediate=intermediate,
        vocab=max((m.num_embeddings for m in embeddings), default=0),
        params=sum(p.numel() for p in model.parameters()),
        mlp="gated" if gated else "plain", experts=experts, top_k=_top_k(model) if experts else 0,
        moe_blocks=moe_blocks, dense_intermediate=dense_intermediate,
    )


def _moe_blocks(blocks: list[tuple[str, Any]]) -> tuple[int, ...] | None:
    """The blocks holding stacked experts; None when none is stacked (experts the cost model cannot see)."""
    found = tuple(index for index, (_, block) in enumerate(blocks) if any(is_experts(m) for m in block.modules()))
    return found or None


def _intermediate(block: Any, hidden: int) -> int:
    """The MLP's inner size: the widest weight dim that is not the hidden size. Stacked experts: each stack's dim
    beside the hidden one, the narrowest (``gate_up_proj`` [E, 2I, H] holds both halves, ``down_proj`` [E, H, I]
    one, in either order), so an expert as wide as the hidden size (I = H) reads as I, not as the dense default."""
    weights = [p for _, p in block.named_parameters() if p.ndim >= 2]
    stacked = [p for p in weights if p.ndim == 3]
    if stacked:
        return min(p.shape[-2] if p.shape[-1] == hidden else p.shape[-1] for p in stacked)
    dims = [d for p in weights for d in p.shape[-2:]]
    return max((d for d in dims if d != hidden), default=4 * hidden)


def _top_k(model: Any) -> int:
    for _, module in model.named_modules():
        for holder in (getattr(module, "config", None), module):
            for attr in TOP_K_ATTRS:
                value = getattr(holder, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return 1
