"""Where a tensor-parallel plan comes from: `resolve_tp_plan` runs the passes in this order, each in the file
named for what it reads.

1. The source: the user's explicit plan, else the plan the model declares (`declared.py`, read with Hugging Face's
   meaning by `hugging_face.py`, its left-out feed-forward layers completed by `names.py`), else name patterns
   (`names.py`: ``q_proj``, ``c_attn``, ``fc1``...).
2. What names leave out, from the blocks' structure (`structure.py`), recurrent mixers (`ssm.py`) and experts stored
   as one weight (`stacked_experts.py`).
3. Checks that refuse (`checks.py`), or the refusal of a model nothing splits with a plan to copy (`suggest.py`).
4. What stays whole (`keep_whole.py`: ties, vocabularies tp does not divide, splits the forward shows wrong,
   `forward_source.py`), and layers with one output per head (`per_feature.py`).
5. What sits beside the split layers: a low-rank latent kept whole (`mla.py`), per-head vectors split with their
   heads (`per_feature.py`), whole parameters whose gradients are partial, and the residual norms under SP.

A plan maps module-name patterns (``*`` matches one name component, as in ``layers.*.q_proj``) to a style name
(`lightning_nd/tensor_parallel/styles.py`); the resolved plan names concrete modules, each with its source.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from lightning_nd.model.structure import (
    ModelFacts,
    find_blocks,
    get_submodule,
    is_linear,
    is_norm,
    parent_name,
)
from lightning_nd.tensor_parallel.infer.checks import (
    check_fused_attention,
    check_partners,
    check_plan,
    check_three_equal_parts,
    is_colwise,
    unequal_parts,
)
from lightning_nd.tensor_parallel.infer.declared import declared_plan, expand
from lightning_nd.tensor_parallel.infer.forward_source import replaced_in_forward
from lightning_nd.tensor_parallel.infer.hugging_face import experts_modules, hf_meaning
from lightning_nd.tensor_parallel.infer.keep_whole import (
    drop_extended_embeddings,
    drop_indivisible_vocabulary,
    drop_tied,
    leave_whole,
    wrong_splits,
)
from lightning_nd.tensor_parallel.infer.mla import colwise_inputs, down_projections, feeds_colwise
from lightning_nd.tensor_parallel.infer.names import (
    NAME_PATTERNS,
    completion_by_names,
    gated_widths,
    paired,
    pattern_plan,
)
from lightning_nd.tensor_parallel.infer.per_feature import per_feature_owners, per_head_outputs
from lightning_nd.tensor_parallel.infer.ssm import selective_scan_plan
from lightning_nd.tensor_parallel.infer.stacked_experts import stacked_experts_plan
from lightning_nd.tensor_parallel.infer.structure import structure_plan
from lightning_nd.tensor_parallel.infer.suggest import no_plan_message
from lightning_nd.tensor_parallel.styles import STACKED_STYLES, STYLES, styles_where

log = logging.getLogger(__name__)

@dataclass
class TPPlan:
    """A resolved plan: concrete module name -> style name (or `ParallelStyle`), plus where it came from."""

    entries: dict[str, object]
    source: str
    sources: dict[str, str]
    """Per module: ``explicit``, ``declared``, ``pattern`` or ``sequence_parallel`` (a residual norm under SP)."""


def custom_styles(model: nn.Module, explicit: Mapping[str, object] | None) -> dict[str, object]:
    """The torch `ParallelStyle` objects of an explicit plan, by concrete module name (the Layout names them only)."""
    objects = {pattern: style for pattern, style in (explicit or {}).items() if not isinstance(style, str)}
    return expand(model, objects) if objects else {}


def _with_out_projections(model: nn.Module, entries: Mapping[str, object]) -> dict[str, object]:
    """An ``nn.MultiheadAttention`` split by heads has its ``out_proj`` rowwise, named or not."""
    added = {f"{name}.out_proj": "rowwise" for name, style in entries.items() if style == "multihead_attention"}
    return {**entries, **added}


def resolve_tp_plan(
    model: nn.Module,
    explicit: Mapping[str, object] | None,
    *,
    tp: int,
    facts: ModelFacts,
    sequence_parallel: bool,
) -> TPPlan:
    """Pick the plan source, expand it to concrete modules, add norms for SP, and check it against tp."""
    entries: Mapping[str, object]
    completion: dict[str, object] = {}
    if explicit:
        entries, source, kind = expand(model, explicit), "the plan passed to `NDParallel(tp_plan=...)`", "explicit"
    elif declared := declared_plan(model):
        blocks = [name for name, _ in find_blocks(model)]
        entries = hf_meaning(model, expand(model, declared, declared=True), blocks)
        source, kind = "the plan the model declares (`_tp_plan`)", "declared"
        completion = completion_by_names(model, entries)
        if completion:
            log.info("The declared tp plan leaves out modules that name patterns split: %s", ", ".join(completion))
            source = "the plan the model declares (`_tp_plan`), completed by name patterns"
        entries = {**entries, **completion}
    else:
        entries, source, kind = pattern_plan(model), "name patterns", "pattern"
    origin = {name: "pattern" if name in completion else kind for name in entries}
    for name, style in entries.items():
        if isinstance(style, str) and style not in STYLES:
            fix = "" if explicit else " The model declares it; override the model's plan with `NDParallel(tp_plan=...)`."
            raise ValueError(f"TP plan entry {name!r} has unknown style {style!r}.{fix} HINT: use one of {STYLES}.")
    entries = _with_out_projections(model, entries)
    check_fused_attention(model, entries)
    if kind == "pattern":  # a guessed fused [q; k; v] of another shape (multi-query) is left out, with its partner
        guessed = {name: style for name, style in entries.items()
                   if style != "packed_qkv" or not unequal_parts(get_submodule(model, name))}
        entries = gated_widths(model, paired(guessed))
    structural: dict[str, object] = {}
    mixers: dict[str, str] = {}
    if kind != "explicit":  # what names leave out, from the blocks' structure (a declared plan: feed-forward only)
        structural = dict(structure_plan(model, entries, tuple(experts_modules(model)), attention=kind == "pattern",
                                         hidden=facts.hidden_size))
        mixers = {**selective_scan_plan(model, {**entries, **structural}),
                  **stacked_experts_plan(model, {**entries, **structural})}
        structural.update(mixers)
        entries = {**entries, **structural}
        origin.update(dict.fromkeys(structural, "structure"))
        if structural and kind == "pattern" and not completion:
            source = "name patterns and the blocks' structure"
    check_three_equal_parts(model, entries)
    splits_experts = kind == "declared" and bool(experts_modules(model))  # split over tp by the layout itself
    shards = styles_where(shards=True)
    if not splits_experts and not any(not isinstance(style, str) or style in shards for style in entries.values()):
        known = NAME_PATTERNS["colwise"][:6]
        raise ValueError(no_plan_message(model, tp, kind == "declared", known))
    entries = drop_extended_embeddings(model, drop_tied(model, entries))
    if kind != "explicit":
        entries = drop_indivisible_vocabulary(model, entries, tp)
    check_partners(entries, source, paired=set(structural))
    restyled = per_head_outputs(model, entries, facts, source, restyle=kind != "explicit")
    entries = {**entries, **restyled}
    origin.update(dict.fromkeys(restyled, "per_head_output"))
    over = wrong_splits(model, entries)
    entries = leave_whole(entries, origin, over, source)
    if swapping := replaced_in_forward(model, entries):
        raise ValueError(f"TP plan ({source}): `{swapping}` replaces its attention module in its forward"
                         " (`set_attention_type`: block-sparse attention falls back to full attention for sequences"
                         " shorter than its blocks), building an unsplit module around the split projections."
                         " HINT: call `set_attention_type('original_full')` on the base model (BigBird's"
                         " `model.bert`) before fit, or build it with `attention_type='original_full'`.")
    sources = {name: origin.get(name, kind) for name in entries}
    split_parents = {parent_name(name) for name, style in entries.items() if is_colwise(style)}
    split_parents -= {name for name, _ in find_blocks(model)} | {""}
    widths = {parent: colwise_inputs(model, entries, parent) for parent in sorted(split_parents)}
    down = down_projections(model, entries, widths)
    heads = {count for count in (facts.num_attention_heads, facts.num_key_value_heads) if count is not None}
    per_feature = per_feature_owners(model, entries, sorted(split_parents), heads)
    partial = [name for name in _partial_gradients(model, entries, widths) if name not in per_feature]
    entries.update(dict.fromkeys(per_feature, "per_head_params"))
    entries.update(dict.fromkeys(partial, "replicated_with_grad_allreduce"))
    entries.update(dict.fromkeys(down, "down_projection"))
    sources.update(dict.fromkeys(partial, "partial_gradient"))
    sources.update(dict.fromkeys(per_feature, "per_feature"))
    sources.update(dict.fromkeys(down, "down_projection"))
    if sequence_parallel:
        norms = [name for name in _residual_norms(model) if name not in entries]
        entries.update(dict.fromkeys(norms, "sequence_parallel"))
        sources.update(dict.fromkeys(norms, "sequence_parallel"))
    else:
        entries = {name: style for name, style in entries.items() if style != "sequence_parallel"}
    check_plan(model, entries, tp, facts)
    # a state-space mixer's layers are read from its own shape, not from the block's: SP follows the block's norms
    if sequence_parallel and kind == "pattern" and (inferred := [name for name in structural if name not in mixers]):
        raise ValueError(f"`NDParallel(sequence_parallel=True)` with a plan inferred from the blocks' structure"
                         f" (`{inferred[0]}`, ...): the structure does not show where the model adds its"
                         " residual stream or normalizes it (BERT's post-norms sit inside its attention and MLP"
                         " modules), which the sequence split must follow. HINT: sequence_parallel=False, or pass"
                         " `NDParallel(tp_plan=...)` naming every split layer and residual norm.")
    if sequence_parallel and (stacked := [name for name, style in entries.items() if style in STACKED_STYLES]):
        raise ValueError(f"`NDParallel(sequence_parallel=True)`: `{stacked[0]}` (experts stored as one weight, JetMoE's)"
                         " is split over tp on tokens every tp rank routes whole; with the sequence split its router"
                         " would see a shard. HINT: sequence_parallel=False for this model.")
    if sequence_parallel and (experts := [name for name, style in entries.items() if style == "transposed_experts"]):
        raise ValueError(f"`NDParallel(sequence_parallel=True)`: `{experts[0]}` (transposed_experts, Llama 4's) is"
                         " split over tp on tokens every tp rank holds whole; with the sequence split the block's"
                         " router would see a shard. HINT: sequence_parallel=False for this model.")
    return TPPlan(entries, source, {name: sources[name] for name in entries})


def _partial_gradients(model: nn.Module, entries: Mapping[str, object], widths: Mapping[str, set[int]]) -> list[str]:
    """Unplanned modules with parameters inside an attention or MLP module whose layers the plan splits (Qwen3-VL-MoE's
    per-head ``q_norm``/``k_norm``, Apertus' xIELU ``act_fn`` with its two scalars): they work on one tp rank's heads
    or features, so each rank's gradient of their (whole) parameters is a part, summed over tp
    (``replicated_with_grad_allreduce``). ``widths``: the modules the plan splits, not blocks (a block's own norms
    see the whole residual stream), each with its colwise layers' input widths. A norm in front of a colwise layer (MLA's ``kv_a_layernorm``,
    `lightning_nd.tensor_parallel.infer.mla`) sees the whole latent and is left whole."""
    found = []
    for parent, inputs in widths.items():
        for child, module in get_submodule(model, parent).named_modules():
            name = f"{parent}.{child}"
            if (child and name not in entries and not is_linear(module) and not isinstance(module, nn.Embedding)
                    and not any(name.startswith(entry + ".") for entry, style in entries.items() if style not in styles_where(owns=True))
                    and any(True for _ in module.parameters(recurse=False))
                    and not (parent_name(name) == parent and feeds_colwise(module, inputs))):
                found.append(name)
    if found:
        log.info("Parameters seeing one tp rank's heads or features, their gradients summed over tp: %s", ", ".join(found))
    return found


def _residual_norms(model: nn.Module) -> list[str]:
    """Norms on the residual stream: direct children of a block, or outside every block (the final norm)."""
    blocks = [name for name, _ in find_blocks(model)]
    norms = []
    for name, module in model.named_modules():
        if not name or not is_norm(module):
            continue
        in_block = [block for block in blocks if name.startswith(block + ".")]
        if not in_block or parent_name(name) in in_block:
            norms.append(name)
    return norms
