"""Name-pattern guesses of a tensor-parallel plan: layer names of the common families (``q_proj``, ``c_attn``,
``fc1``...) mapped to styles, a guessed layer kept only with its colwise/rowwise partner and at consistent widths, and
the feed-forward layers a declared plan leaves out (`completion_by_names`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import nn

from lightning_nd.model.structure import find_blocks, get_submodule, is_linear, parent_name, widths
from lightning_nd.tensor_parallel.infer.checks import is_colwise
from lightning_nd.tensor_parallel.infer.hugging_face import experts_modules
from lightning_nd.tensor_parallel.styles import style_has

log = logging.getLogger(__name__)

NAME_PATTERNS = {
    "colwise": ("q_proj", "k_proj", "v_proj", "wq", "wk", "wv", "query", "key", "value",
                "gate_proj", "up_proj", "w1", "w3", "fc1", "c_fc"),
    "rowwise": ("o_proj", "wo", "out_proj", "down_proj", "w2", "fc2", "c_proj"),
    "packed_colwise": ("gate_up_proj", "w13"),
    "packed_qkv": ("c_attn",),  # GPT-2's fused [q; k; v], split by `split_size`
    "embedding_rowwise": ("embed_tokens", "tok_embeddings", "wte", "word_embeddings", "tok_emb", "token_embedding"),
    "colwise_gather_output": ("lm_head", "output", "head", "out"),
}
MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "fc1", "fc2", "c_fc", "gate_up_proj", "w13")
"""The feed-forward layers a declared plan is completed with: attention left out of a declared plan may carry
per-head state the names do not show (sinks, differential heads), so only MLP pairs are added by name."""


def pattern_plan(model: nn.Module) -> dict[str, str]:
    """Name-pattern detection of the common families; heads and embeddings only outside the blocks."""
    blocks = [name for name, _ in find_blocks(model)]
    inside = lambda name: any(name.startswith(block + ".") for block in blocks)  # noqa: E731
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        for style, leaves in NAME_PATTERNS.items():
            if leaf not in leaves:
                continue
            outer_only = style_has(style, outer=True)
            kind_ok = isinstance(module, nn.Embedding) if style == "embedding_rowwise" else is_linear(module)
            if kind_ok and not (outer_only and inside(name)):
                plan[name] = style
        if isinstance(module, nn.MultiheadAttention):  # split by heads as a whole (its out_proj: rowwise by name)
            plan[name] = "multihead_attention"
    return plan


def completion_by_names(model: nn.Module, declared: Mapping[str, object]) -> dict[str, object]:
    """What name patterns split that a declared plan leaves out (transformers declares only the embedding for
    Bamba, only the experts for Jamba or PhiMoE): paired feed-forward layers (`MLP_NAMES`) in modules the declared
    plan names nothing in and whose other layers are not attention (an attention's ``gate_proj`` is not an MLP's),
    outside experts modules (the layout splits those over tp itself)."""
    experts = experts_modules(model)
    claimed = {parent_name(name) for name in declared}
    guessed = gated_widths(model, paired(pattern_plan(model)))
    mixed = {parent_name(name) for name in guessed if name.rsplit(".", 1)[-1] not in MLP_NAMES}
    return {name: style for name, style in guessed.items()
            if name not in declared and parent_name(name) not in claimed | mixed
            and not any(name == e or name.startswith(e + ".") for e in experts)}


def paired(entries: Mapping[str, object]) -> dict[str, object]:
    """Name patterns guess; a guessed colwise layer without its rowwise partner (or the reverse) is left out."""
    sides: dict[str, set[str]] = {}
    group = lambda name, style: name if style == "multihead_attention" else parent_name(name)  # noqa: E731
    fans_out = lambda style: is_colwise(style) or style == "multihead_attention"  # noqa: E731
    for name, style in entries.items():
        if fans_out(style) or style == "rowwise":
            sides.setdefault(group(name, style), set()).add("colwise" if fans_out(style) else "rowwise")
    alone = {name for name, style in entries.items()
             if (fans_out(style) or style == "rowwise") and len(sides[group(name, style)]) == 1}
    if alone:
        log.info("Left out of the tp plan, found without a colwise/rowwise partner: %s", ", ".join(sorted(alone)))
    return {name: style for name, style in entries.items() if name not in alone}


def gated_widths(model: nn.Module, entries: Mapping[str, object]) -> dict[str, object]:
    """A guessed feed-forward layer whose width is twice its rowwise partner's input is a fused ``[gate; up]``
    (Moshi's ``fc1``, split in halves by its forward): ``packed_colwise``, each half split on its own. Another
    width mismatch leaves the module's pair whole."""
    rowwise_in = {parent_name(name): widths(get_submodule(model, name))[0]
                  for name, style in entries.items() if style == "rowwise"}
    result, whole = dict(entries), set()
    for name, style in entries.items():
        parent = parent_name(name)
        if style != "colwise" or name.rsplit(".", 1)[-1] not in MLP_NAMES or parent not in rowwise_in:
            continue
        out = widths(get_submodule(model, name))[1]
        if out == 2 * rowwise_in[parent]:
            result[name] = "packed_colwise"
        elif out != rowwise_in[parent]:
            whole.add(parent)
    if whole:
        log.info("Left out of the tp plan, a feed-forward pair of unmatched widths: %s", ", ".join(sorted(whole)))
    return {name: style for name, style in result.items() if parent_name(name) not in whole}
