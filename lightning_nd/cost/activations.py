"""Activation memory of one transformer block, after Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", section 4), and what a rank keeps of it.

The paper counts the tensors a block saves for backward, per token, by where they live: in the residual
stream (whole on every tp rank, split along the sequence by sequence parallelism), inside attention and the
MLP (split by tp), and the attention scores (a x s per token, gone with a fused/flash kernel). `korthikanti_*`
are the paper's closed forms, for its GPT block (fp16, dropout, materialised scores); `saved_tensors` lists the
same for the blocks this project runs, read off their code (`examples/models`): a gated (SwiGLU) block saves
8h + 2kv + 4I values and one fp32 logsumexp per head and token; a plain (GELU) block 8h + 2I and the same
logsumexp. Differences from the paper: no dropout; SDPA saves its output and logsumexp, not the scores; under
torch's sequence parallel the all-gathered input of a column-parallel matmul is saved whole (the paper
re-gathers it in backward).

Recomputation: ``full`` keeps each block's input only, and recomputes one block at a time in backward;
``selective`` keeps what `parallel/activation.py` marks must-save: the outputs of matmuls and of attention,
plus the block input.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_nd.cost.shape import ModelShape

LSE_BYTES = 4  # SDPA's logsumexp is fp32 whatever the activations' dtype


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, *, sequence_parallel: bool = False,
                            recompute: str = "none") -> float:
    """Bytes one GPT layer keeps for backward in fp16 (the paper's equations 1-4 and section 5)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    scores = 0 if recompute == "selective" else 5 * a * s / (h * t)
    if sequence_parallel:
        return s * b * h * (34 / t + scores)
    if recompute == "selective":
        return s * b * h * (10 + 24 / t)
    return s * b * h * (10 + 24 / t + scores)


@dataclass(frozen=True)
class Saved:
    """A group of tensors a block saves, per token: ``elements`` values of ``bytes`` each."""

    what: str
    elements: int
    bytes: int
    split: str
    """``tp``: cut by tensor parallelism; ``residual``: whole on each tp rank, cut by sequence parallelism;
    ``gathered``: whole on each tp rank even under sequence parallelism."""


def saved_tensors(shape: ModelShape, element_bytes: int, recompute: str = "none", *, cp: int = 1, ep: int = 1,
                  etp: bool = False, moe: bool = True) -> tuple[Saved, ...]:
    """What one block saves per token (see the module docstring). ``cp`` > 1: attention is the ring of
    `context_parallel/ring_attention.py`, which keeps what the fused kernel keeps for this rank's tokens. ``etp``: experts
    split over tp (their intermediates are cut by tp). ``moe``: False for a dense block of an MoE model."""
    h, e = shape.hidden, element_bytes
    if recompute == "full":
        return (Saved("block input", h, e, "residual"),)
    attention = attention_saved(shape, e, cp, recompute)
    mlp = _mlp(shape, e, recompute, ep, etp, moe)
    if recompute == "selective":
        return (Saved("block input", h, e, "residual"), *attention, *mlp,
                # row-parallel matmuls (attention output, a dense MLP's down) return partial sums, whole on each
                # tp rank (experts keep their down projection's output per copy, above)
                Saved("row-parallel matmul outputs", (1 if shape.experts and moe else 2) * h, e, "gathered"))
    return (
        Saved("norm inputs", 2 * h, e, "residual"),
        Saved("normed (gated block: RMSNorm keeps its product)", 2 * h if shape.mlp == "gated" else 0, e, "residual"),
        Saved("norm outputs, matmul inputs", 2 * h, e, "gathered"),
        *attention, *mlp,
    )


def attention_saved(shape: ModelShape, e: int, cp: int = 1, recompute: str = "none") -> tuple[Saved, ...]:
    h, heads = shape.hidden, shape.heads
    kept = (Saved("query and attention output", 2 * h, e, "tp"), Saved("keys and values", 2 * shape.kv_dim, e, "tp"),
            Saved("logsumexp", heads, LSE_BYTES, "tp"))
    if cp == 1 or recompute != "selective":
        # SDPA's fused kernel, and the ring (`context_parallel/ring_attention.py`), whose backward recomputes block by block
        # from these: the query, the output, this rank's own K and V (not expanded) and the fp32 log-sum-exp.
        return kept
    # Selective recomputation also keeps the outputs of the fused-kernel calls inside the ring (the policy saves
    # attention kernels' outputs): measured with torch's MemTracker at S = 2048 (8 heads, head dim 64), the worst
    # rank keeps cp x (output + log-sum-exp) per token beyond what the ring saves itself (cp = 2: 2.0, cp = 4:
    # 3.98; the first rank of cp = 4 keeps 2.99).
    return (Saved("query, key and value projections", h + 2 * shape.kv_dim, e, "tp"), *kept,
            Saved("each ring block's partial output", cp * h, e, "tp"),
            Saved("each ring block's log-sum-exp", cp * heads, LSE_BYTES, "tp"))


def _mlp(shape: ModelShape, e: int, recompute: str, ep: int, etp: bool = False, moe: bool = True) -> tuple[Saved, ...]:
    inner, h = shape.intermediate, shape.hidden
    gated = shape.mlp == "gated"
    if not shape.experts or not moe:  # a dense block of an MoE model has its own inner size
        inner = shape.dense_intermediate if shape.experts and shape.dense_intermediate else inner
        elements = (2 if gated else 1) * inner if recompute == "selective" else (4 if gated else 2) * inner
        return (Saved("MLP matmul outputs" if recompute == "selective" else "MLP intermediates", elements, e, "tp"),)
    # Mixture of experts (`nn/moe.py`, `expert_parallel/dispatch.py`), per copy of a token (k of them): the copy gathered
    # for its expert (h), the expert's gate/up output (2I), activation and product (2I), its output (h) and the
    # weighted output the scatter-add keeps (h); under ep the expert's output is kept by the out-of-place
    # add that collects it and the copy that comes back by the weighting (h more). Selective keeps the
    # matmuls' 2I + h. The router keeps fp32 logits and softmax twice (gate, auxiliary loss) per expert, and
    # four int64 indices per copy. Without ETP each tp rank runs the experts whole; split over tp (``etp``), the
    # intermediates (2I, 4I) are cut by tp, the copies and outputs (h) are whole on each tp rank, one more (h) kept
    # as under ep by the out-of-place add that collects the outputs.
    k = shape.top_k
    copies = h if recompute == "selective" else (3 + (ep > 1 or etp)) * h
    inner_elements = 2 * inner if recompute == "selective" else (4 if gated else 2) * inner
    return (Saved("expert copies of each token", k * copies, e, "gathered"),
            Saved("expert intermediates", k * inner_elements, e, "tp" if etp else "gathered"),
            Saved("router logits and scores", (1 if recompute == "selective" else 3) * shape.experts, 4, "gathered"),
            Saved("routing indices", 0 if recompute == "selective" else 4 * k, 8, "gathered"))


def block_bytes(shape: ModelShape, tokens: int, element_bytes: int, *, tp: int = 1, sequence_parallel: bool = False,
                recompute: str = "none", cp: int = 1, ep: int = 1, etp: bool = False,
                moe: bool = True) -> int:
    """Bytes one block keeps between its forward and its backward, for ``tokens`` tokens on this rank
    (micro-batch x local sequence), with its tp split and recomputation mode."""
    total = 0
    for saved in saved_tensors(shape, element_bytes, recompute, cp=cp, ep=ep, etp=etp, moe=moe):
        divisor = tp if saved.split == "tp" or (saved.split == "residual" and sequence_parallel) else 1
        total += tokens * saved.elements * saved.bytes // divisor
    return total


def block_backward_bytes(shape: ModelShape, tokens: int, element_bytes: int, *, tp: int = 1) -> int:
    """The gradients alive at once inside one block's backward: the incoming gradient (h) and, in the MLP's
    backward, those of its two branches (2I per token, k copies under MoE)."""
    copies = shape.top_k if shape.experts else 1
    return tokens * (shape.hidden + 2 * shape.intermediate * copies // tp) * element_bytes


def head_bytes(shape: ModelShape, tokens: int, element_bytes: int, *, tp: int = 1, loss_parallel: bool = False) -> int:
    """The last stage's extra: the final norm's saved input and output, and the fp32 log-probabilities the
    cross-entropy keeps (a vocabulary shard each under loss_parallel)."""
    vocab = shape.vocab // (tp if loss_parallel else 1)
    return tokens * (2 * shape.hidden * element_bytes + vocab * 4)


def logits_bytes(shape: ModelShape, tokens: int, *, tp: int = 1, loss_parallel: bool = False) -> int:
    """One fp32 [tokens, vocab] tensor: the loss's gradient buffers in backward are two of these."""
    return tokens * shape.vocab // (tp if loss_parallel else 1) * 4
