"""Checks of a resolved tensor-parallel plan, made while planning: sizes divide by tp, every split layer has
its partner, a layer with one output per head is split with the heads, nothing is planned that the styles
cannot split (``nn.MultiheadAttention``), which vocabulary-split embeddings must stay whole; and how each
style splits a parameter, which the Layout's per-rank holdings follow.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from lightning_nd.mesh.dims import divisors
from lightning_nd.model.structure import (
    HEAD_ATTRS,
    KV_HEAD_ATTRS,
    ModelFacts,
    get_submodule,
    is_conv1d,
    is_linear,
    is_norm,
    owns_parameters,
    parent_name,
    torch_class,
    widths,
)
from lightning_nd.tensor_parallel.styles import PACKED_PARTS, STACKED_STYLES, style_has

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel



def is_torch_style(value: object, name: str = "ParallelStyle") -> bool:
    """``isinstance(value, torch.distributed.tensor.parallel.<name>)``, without importing it."""
    cls = torch_class("torch.distributed.tensor.parallel", name)
    return cls is not None and isinstance(value, cls)


def is_colwise(style: object) -> bool:
    """Styles that fan a module's input out into per-rank heads or features."""
    # A ColwiseParallel exists only once torch.distributed.tensor, and so its Replicate, is loaded.
    return style_has(style, sharded_output=True) or (is_torch_style(style, "ColwiseParallel") and not isinstance(
        cast("ColwiseParallel", style).output_layouts[0],
        cast(type, torch_class("torch.distributed.tensor", "Replicate"))))


def head_counts(module: nn.Module) -> dict[str, int]:
    """The head-count attributes a module reshapes with (``n_heads``, ``num_key_value_heads``, ...)."""
    values = {attr: getattr(module, attr, None) for attr in (*HEAD_ATTRS, *KV_HEAD_ATTRS)}
    return {attr: value for attr, value in values.items() if isinstance(value, int) and not isinstance(value, bool)}


def check_plan(model: nn.Module, entries: Mapping[str, object], tp: int, facts: ModelFacts) -> None:
    """Every sharded dimension and every head count must divide by tp."""
    for fact in ("num_attention_heads", "num_key_value_heads"):
        count = getattr(facts, fact)
        if count is not None and count % tp:
            raise ValueError(
                f"`NDParallel(tp={tp})` does not divide `{fact}={count}` (read from {facts.sources[fact]})."
                f" HINT: choose tp from {divisors(count)}."
            )
    for name in sorted({parent_name(name) for name, style in entries.items() if is_colwise(style)}):
        for attr, value in head_counts(get_submodule(model, name)).items():
            if value % tp:
                raise ValueError(f"`NDParallel(tp={tp})` does not divide `{name or 'model'}.{attr}={value}`: its heads"
                                 f" would be split mid-head. HINT: choose tp from {divisors(value)}.")
    for name, style in entries.items():
        module = get_submodule(model, name)
        if style == "multihead_attention" and (heads := cast(nn.MultiheadAttention, module).num_heads) % tp:
            raise ValueError(f"`NDParallel(tp={tp})` does not divide `{name}.num_heads={heads}`: its heads would be"
                             f" split mid-head. HINT: choose tp from {divisors(heads)}.")
        if style == "transposed_experts" and (inner := cast(torch.Tensor, module.down_proj).shape[1]) % tp:
            raise ValueError(f"`NDParallel(tp={tp})` does not divide the intermediate size {inner} of `{name}`'s"
                             f" experts (transposed_experts). HINT: choose tp from {divisors(inner)}.")
        for param_name, param in module.named_parameters(recurse=False) if style == "per_head_params" else ():
            if param.shape[0] % tp:
                raise ValueError(f"`NDParallel(tp={tp})` does not divide `{name}.{param_name}`'s {param.shape[0]} heads"
                                 f" (per_head_params). HINT: choose tp from {divisors(param.shape[0])}.")
        size, what = _sharded_size(module, style)
        if size is not None and size % tp:
            raise ValueError(
                f"`NDParallel(tp={tp})` does not divide `{name}.{what}={size}` ({style})."
                f" HINT: choose tp dividing {size}, or pass `NDParallel(tp_plan=...)` without `{name}`."
            )


MHA_SPLITS = {"in_proj_weight": (0, 3), "q_proj_weight": (0, 1), "k_proj_weight": (0, 1), "v_proj_weight": (0, 1),
              "bias_k": (2, 1), "bias_v": (2, 1)}
"""How the ``multihead_attention`` style splits an ``nn.MultiheadAttention``'s own parameters (its out_proj:
rowwise)."""

SIZE_NAMES = {"Embedding": ("num_embeddings", "embedding_dim"), "Conv1D": ("nx", "nf")}
"""The attribute naming each weight dim (``nn.Linear``: out_features, in_features)."""


def _sharded_size(module: nn.Module, style: object) -> tuple[int | None, str]:
    if style_has(style, by_heads=True):  # its head counts are checked (`fused_heads.check_fused_heads`)
        return None, ""
    split = tp_split(module, "weight", style)
    weight = getattr(module, "weight", None)
    if style in STACKED_STYLES and split is not None and isinstance(weight, torch.Tensor):
        return weight.shape[split[0]] // split[1], f"experts' {'outputs' if split[0] == 1 else 'inputs'}"
    if split is None or weight is None or weight.ndim != 2:
        return None, ""
    dim, parts = split
    kind = "Embedding" if isinstance(module, nn.Embedding) else "Conv1D" if is_conv1d(module) else "Linear"
    what = SIZE_NAMES.get(kind, ("out_features", "in_features"))[dim]
    return weight.shape[dim] // parts, what + (f"/{parts}" if parts > 1 else "")


def tp_split(module: nn.Module, param_name: str, style: object) -> tuple[int, int] | None:
    """(dim, parts) that a tp style splits this parameter on (``parts`` > 1: each of that many equal parts is
    split on its own, a ``_StridedShard``); None when it stays whole on every tp rank."""
    # A colwise style object may split a fused weight part by part (`FusedColwiseParallel.parts`).
    parts = PACKED_PARTS.get(style, getattr(style, "parts", 1) if is_torch_style(style, "ColwiseParallel") else 1)
    if style in ("per_head_params", "channel_mixer", "channel_params"):  # with the heads, features or channels
        return 0, 1
    if style in STACKED_STYLES:  # experts stored as one [E, out, in] weight
        return STACKED_STYLES[style] if param_name == "weight" else None
    if style == "per_channel_vectors":  # RWKV's per-channel vectors; its input-mixing weights whole
        param = getattr(module, param_name, None)
        return (0, 1) if isinstance(param, torch.Tensor) and param.ndim == 1 else None
    if style == "multihead_attention":  # `tensor_parallel/apply/attention.py`: by heads; the packed bias whole
        return MHA_SPLITS.get(param_name)
    if style == "transposed_experts":  # Llama 4's [E, H, 2I] / [E, I, H]: each expert's intermediate features
        return {"gate_up_proj": (2, 2), "down_proj": (1, 1)}.get(param_name)
    colwise = style_has(style, weight="colwise") or is_torch_style(style, "ColwiseParallel")
    rowwise = style_has(style, weight="rowwise") or is_torch_style(style, "RowwiseParallel")
    if isinstance(module, nn.Embedding):
        return (1, 1) if colwise else (0, 1) if rowwise else None
    out_dim = 1 if is_conv1d(module) else 0
    if colwise and param_name != "weight" and parts > 1:  # a fused layer's bias: whole (`FusedColwiseParallel`)
        return None
    if colwise:
        return (out_dim if param_name == "weight" else 0), parts
    if rowwise and param_name == "weight":
        return 1 - out_dim, 1
    return None


def check_partners(entries: Mapping[str, object], source: str, paired: Collection[str] = ()) -> None:
    """A layer whose output stays split needs the rowwise layer that takes it back, in the same module, and the
    reverse: alone, either would hand the next layer a tensor of the wrong width. ``paired``: layers planned from
    the structure, whose partner may sit in the next module (BERT's ``attention.output.dense``)."""
    by_parent: dict[str, dict[str, list[str]]] = {}
    for name, style in entries.items():
        if name in paired:
            continue
        fans_out = is_colwise(style) or style == "multihead_attention"
        side = "colwise" if fans_out else "rowwise" if _is_plain_rowwise(style) else None
        if side is not None:  # an nn.MultiheadAttention's partner is its own out_proj
            parent = name if style == "multihead_attention" else parent_name(name)
            by_parent.setdefault(parent, {"colwise": [], "rowwise": []})[side].append(name)
    for parent, sides in by_parent.items():
        for side, other in (("colwise", "rowwise"), ("rowwise", "colwise")):
            if sides[side] and not sides[other] and not _nested_partner(parent, other, by_parent):
                raise ValueError(
                    f"TP plan ({source}): `{sides[side][0]}` is {side} but `{parent or 'the model'}` has no {other}"
                    f" layer to pair with it, so the next layer would get a tensor of the wrong width. HINT: add the"
                    f" {other} partner (e.g. {_partner_example(side)}) to `NDParallel(tp_plan=...)`, or leave"
                    f" `{sides[side][0]}` out; 'colwise_rep' and 'rowwise_split_input' stand alone."
                )


def _nested_partner(parent: str, side: str, by_parent: Mapping[str, Mapping[str, list[str]]]) -> bool:
    """A partner one module deeper or higher inside the same module: NeoMME's ``o_proj`` sits in the attention's
    ``output_projection`` (beside a colwise gate of its own), its q/k/v in the attention."""
    def nested(a: str, b: str) -> bool:
        return bool(a) and b.startswith(a + ".")
    return any(names[side] and (nested(parent, other) or nested(other, parent)) for other, names in by_parent.items())


def vocabulary_split_with_own_forward(model: nn.Module, entries: Mapping[str, object]) -> list[str]:
    """Vocabulary-split embeddings (``embedding_rowwise``) whose class runs more than the lookup in its own
    ``forward`` (Muse Glimmer's ``MuseGlimmerTextNormedEmbedding`` normalizes the looked-up rows): the lookup is a
    partial sum over tp ranks until the module returns, so that code would run on partial sums."""
    return sorted(name for name, style in entries.items()
                  if style == "embedding_rowwise" and type(get_submodule(model, name)).forward is not nn.Embedding.forward)


def _is_plain_rowwise(style: object) -> bool:
    if is_torch_style(style, "RowwiseParallel"):
        return isinstance(cast("RowwiseParallel", style).input_layouts[0],
                          cast(type, torch_class("torch.distributed.tensor", "Shard")))
    return style == "rowwise" or style_has(style, weight="rowwise", by_heads=True)


def _partner_example(side: str) -> str:
    return "'o_proj'/'down_proj': 'rowwise'" if side == "colwise" else "'q_proj'/'up_proj': 'colwise'"


def check_fused_attention(model: nn.Module, entries: Mapping[str, object]) -> None:
    """An ``nn.MultiheadAttention`` is split whole, by heads (``multihead_attention``, its ``out_proj`` rowwise): it
    runs ``F.multi_head_attention_forward`` on its fused ``in_proj_weight`` and reads ``out_proj.weight`` without
    calling ``out_proj``, so a plan naming some of its parts only (``out_proj`` by name) is refused."""
    for name, module in model.named_modules():
        if not isinstance(module, nn.MultiheadAttention):
            continue
        inside = {entry: style for entry, style in entries.items() if entry == name or entry.startswith(name + ".")}
        if inside and inside != {name: "multihead_attention", f"{name}.out_proj": "rowwise"}:
            raise ValueError(
                f"TP plan names {', '.join(f'`{entry}`: {style!r}' for entry, style in sorted(inside.items()))}, part"
                f" of `{name}`, an `nn.MultiheadAttention`: it is split by heads as a whole or not at all."
                f" HINT: pass `NDParallel(tp_plan={{'{name}': 'multihead_attention', '{name}.out_proj': 'rowwise'}})`"
                " (with `*` for the layer number), or leave it out of the plan (it stays whole on every tp rank)."
            )


def unequal_parts(module: nn.Module) -> tuple[int, int] | None:
    """(input width, output width) of a fused ``[q; k; v]`` that is not three parts of the input's width each
    (GPT-BigCode's multi-query ``c_attn``: all query heads, one shared key and value head); None when it is."""
    weight = getattr(module, "weight", None)
    if weight is None or weight.ndim != 2:
        return None
    width, out = widths(module)
    return None if out == 3 * width else (width, out)


def check_three_equal_parts(model: nn.Module, entries: Mapping[str, object]) -> None:
    """``packed_qkv`` splits a fused ``[q; k; v]`` as three equal parts (GPT-2's ``c_attn``); another shape would be
    cut across q, k and v. (A name-pattern guess of that shape is left out instead, `tp_plan._paired`.)"""
    for name, style in entries.items():
        if style == "packed_qkv" and (shape := unequal_parts(get_submodule(model, name))):
            raise ValueError(f"TP plan: `{name}` is packed_qkv (three equal parts q, k, v), but it maps {shape[0]}"
                             f" features to {shape[1]}, not {3 * shape[0]}: multi-query or grouped key/value heads,"
                             " which this style would cut across q, k and v. HINT: leave the attention out of"
                             " `NDParallel(tp_plan=...)` (it stays whole on every tp rank) and split the MLP only.")


def _feed_forward_plan(block: nn.Module) -> dict[str, str]:
    """The block's own linear children (``nn.TransformerEncoderLayer``'s ``linear1``/``linear2``), fan-out first."""
    linears = [(child, module) for child, module in block.named_children() if isinstance(module, nn.Linear)]
    if len(linears) != 2:
        return {}
    return {child: "colwise" if module.out_features >= module.in_features else "rowwise" for child, module in linears}


HEAD_DIM_ATTRS = ("head_dim", "head_size", "attention_head_size", "kv_channels")
"""Attributes an attention module keeps its per-head width in."""


def norms_over_split_features(model: nn.Module, entries: Mapping[str, object]) -> dict[str, str]:
    """Modules whose layers a plan splits that hold a norm over the split features, which each tp rank would normalize
    on its own part (BitNet's ``attn_sub_norm`` over the concatenated heads, ``ffn_sub_norm`` over the MLP's inner
    features): parent -> norm. A norm counts when its width is a colwise layer's output width and either not an input
    width there or registered after the colwise layers (a pre-norm of the input comes before them). A norm without
    parameters, whose width nothing shows, counts when it is registered after the colwise layers of an MLP (no
    heads, widening its input, no linear layers but its split ones) (Dory's ``ffn_sub_norm``, an L2 norm over the MLP's inner features; a weightless
    norm in an attention module normalizes each head's query or key)."""
    found = {}
    for parent in sorted({parent_name(name) for name, style in entries.items() if is_colwise(style)}):
        owner = get_submodule(model, parent)
        children = list(owner.named_children())
        prefix = f"{parent}." if parent else ""
        # an MLP: linear layers only its colwise ones and the rowwise ones reading their outputs
        mlp = all(is_colwise(entries.get(prefix + child)) or entries.get(prefix + child) == "rowwise"
                  for child, layer in children if is_linear(layer))
        colwise = [index for index, (child, _) in enumerate(children) if is_colwise(entries.get(prefix + child))]
        outputs = {widths(children[index][1])[1] for index in colwise}
        inputs = {widths(children[index][1])[0] for index in colwise}
        for index, (child, module) in enumerate(children):
            width = {param.shape[0] for param in module.parameters(recurse=False) if param.ndim == 1}
            if not is_norm(module) or prefix + child in entries:
                continue
            weightless = (not owns_parameters(module) and index > max(colwise) and not outputs & inputs and mlp
                          and not head_counts(owner) and not any(hasattr(owner, attr) for attr in HEAD_DIM_ATTRS))
            if weightless or len(width) == 1 and width <= outputs and (not width <= inputs or index > max(colwise)):
                found[parent] = prefix + child
    return found

