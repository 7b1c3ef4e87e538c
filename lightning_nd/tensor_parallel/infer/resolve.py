"""Where a tensor-parallel plan comes from: `resolve_tp_plan` runs `PASSES` in order, each a function here
calling the file named for what it reads.

1. The source: the user's explicit plan, else the plan the model declares (`declared.py`, read with Hugging Face's
   meaning by `hugging_face.py`, its left-out feed-forward layers completed by `names.py`), else name patterns
   (`names.py`: ``q_proj``, ``c_attn``, ``fc1``...).
2. What names leave out, from the blocks' structure (`structure.py`, and `fused_heads.py` for a fused ``[q; k; v]``
   sized by head counts), recurrent mixers (`ssm.py`) and experts stored as one weight (`stacked_experts.py`).
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn

from lightning_nd.model.structure import (
    ModelFacts,
    find_blocks,
    get_submodule,
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
from lightning_nd.tensor_parallel.infer.fused_heads import check_fused_heads, fused_heads_plan
from lightning_nd.tensor_parallel.infer.hugging_face import experts_modules, hf_meaning
from lightning_nd.tensor_parallel.infer.keep_whole import (
    drop_extended_embeddings,
    drop_indivisible_vocabulary,
    drop_tied,
    leave_whole,
    wrong_splits,
)
from lightning_nd.tensor_parallel.infer.mla import colwise_inputs, down_projections
from lightning_nd.tensor_parallel.infer.names import (
    NAME_PATTERNS,
    completion_by_names,
    gated_widths,
    paired,
    pattern_plan,
)
from lightning_nd.tensor_parallel.infer.per_feature import partial_gradients, per_feature_owners, per_head_outputs
from lightning_nd.tensor_parallel.infer.ssm import selective_scan_plan
from lightning_nd.tensor_parallel.infer.stacked_experts import stacked_experts_plan
from lightning_nd.tensor_parallel.infer.structure import structure_plan
from lightning_nd.tensor_parallel.infer.suggest import no_plan_message
from lightning_nd.tensor_parallel.styles import STACKED_STYLES, STYLES, style_has

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


@dataclass
class _Resolution:
    """A plan while its passes run: what each pass reads, and what it leaves for the next."""

    model: nn.Module
    explicit: Mapping[str, object] | None
    tp: int
    facts: ModelFacts
    sequence_parallel: bool
    entries: dict[str, object] = field(default_factory=dict)
    source: str = ""
    kind: str = ""
    """``explicit``, ``declared`` or ``pattern``: where the first entries came from."""
    origin: dict[str, str] = field(default_factory=dict)
    completion: dict[str, object] = field(default_factory=dict)
    structural: dict[str, object] = field(default_factory=dict)
    mixers: dict[str, str] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)


def _source(plan: _Resolution) -> None:
    """The user's explicit plan, else the model's declared plan completed by names, else name patterns."""
    model, explicit = plan.model, plan.explicit
    if explicit:
        plan.entries, plan.kind = {**expand(model, explicit)}, "explicit"
        plan.source = "the plan passed to `NDParallel(tp_plan=...)`"
    elif declared := declared_plan(model):
        blocks = [name for name, _ in find_blocks(model)]
        entries: dict[str, object] = {**hf_meaning(model, expand(model, declared, declared=True), blocks)}
        plan.source, plan.kind = "the plan the model declares (`_tp_plan`)", "declared"
        plan.completion = completion_by_names(model, entries)
        if plan.completion:
            log.info("The declared tp plan leaves out modules that name patterns split: %s", ", ".join(plan.completion))
            plan.source = "the plan the model declares (`_tp_plan`), completed by name patterns"
        plan.entries = {**entries, **plan.completion}
    else:
        plan.entries, plan.source, plan.kind = {**pattern_plan(model)}, "name patterns", "pattern"
    plan.origin = {name: "pattern" if name in plan.completion else plan.kind for name in plan.entries}
    for name, style in plan.entries.items():
        if isinstance(style, str) and style not in STYLES:
            fix = "" if explicit else " The model declares it; override the model's plan with `NDParallel(tp_plan=...)`."
            raise ValueError(f"TP plan entry {name!r} has unknown style {style!r}.{fix} HINT: use one of {STYLES}.")


def _names(plan: _Resolution) -> None:
    """``nn.MultiheadAttention``'s out projections; guessed layers kept only paired and at consistent widths."""
    plan.entries = _with_out_projections(plan.model, plan.entries)
    check_fused_attention(plan.model, plan.entries)
    if plan.kind == "pattern":  # a guessed fused [q; k; v] of another shape (multi-query) is left out, with its partner
        guessed = {name: style for name, style in plan.entries.items()
                   if style != "packed_qkv" or not unequal_parts(get_submodule(plan.model, name))}
        plan.entries = gated_widths(plan.model, paired(guessed))


def _structure(plan: _Resolution) -> None:
    """What names leave out, from the blocks' structure (a declared plan: feed-forward only), mixers and experts."""
    if plan.kind == "explicit":
        return
    model, entries = plan.model, plan.entries
    structural: dict[str, object] = dict(fused_heads_plan(model, entries)) if plan.kind == "pattern" else {}
    structural.update(structure_plan(model, {**entries, **structural}, tuple(experts_modules(model)),
                                     attention=plan.kind == "pattern", hidden=plan.facts.hidden_size))
    plan.mixers = {**selective_scan_plan(model, {**entries, **structural}),
                   **stacked_experts_plan(model, {**entries, **structural})}
    structural.update(plan.mixers)
    plan.structural, plan.entries = structural, {**entries, **structural}
    plan.origin.update(dict.fromkeys(structural, "structure"))
    if structural and plan.kind == "pattern" and not plan.completion:
        plan.source = "name patterns and the blocks' structure"


def _splits_something(plan: _Resolution) -> None:
    """A plan that splits nothing is refused with a plan to copy."""
    check_three_equal_parts(plan.model, plan.entries)
    splits_experts = plan.kind == "declared" and bool(experts_modules(plan.model))  # split over tp by the layout itself
    if not splits_experts and not any(not isinstance(style, str) or style_has(style, shards=True) for style in plan.entries.values()):
        known = NAME_PATTERNS["colwise"][:6]
        raise ValueError(no_plan_message(plan.model, plan.tp, plan.kind == "declared", known))


def _keep_whole(plan: _Resolution) -> None:
    """Ties, extended embeddings and vocabularies tp does not divide stay whole; every split layer has its partner."""
    plan.entries = drop_extended_embeddings(plan.model, drop_tied(plan.model, plan.entries))
    if plan.kind != "explicit":
        plan.entries = drop_indivisible_vocabulary(plan.model, plan.entries, plan.tp)
    check_partners(plan.entries, plan.source, paired=set(plan.structural))


def _per_head_outputs(plan: _Resolution) -> None:
    """Layers with one output per head are split with the heads."""
    restyled = per_head_outputs(plan.model, plan.entries, plan.facts, plan.source, restyle=plan.kind != "explicit")
    plan.entries = {**plan.entries, **restyled}
    plan.origin.update(dict.fromkeys(restyled, "per_head_output"))


def _wrong_splits(plan: _Resolution) -> None:
    """Splits the model shows to be wrong (its norms, its forward's reshapes) are left whole or refused."""
    over = wrong_splits(plan.model, plan.entries)
    plan.entries = leave_whole(plan.entries, plan.origin, over, plan.source)
    if swapping := replaced_in_forward(plan.model, plan.entries):
        raise ValueError(f"TP plan ({plan.source}): `{swapping}` replaces its attention module in its forward"
                         " (`set_attention_type`: block-sparse attention falls back to full attention for sequences"
                         " shorter than its blocks), building an unsplit module around the split projections."
                         " HINT: call `set_attention_type('original_full')` on the base model (BigBird's"
                         " `model.bert`) before fit, or build it with `attention_type='original_full'`.")


def _beside_split_layers(plan: _Resolution) -> None:
    """A latent kept whole before a colwise layer, per-head vectors split, whole parameters with partial gradients."""
    model, entries, facts = plan.model, plan.entries, plan.facts
    plan.sources = {name: plan.origin.get(name, plan.kind) for name in entries}
    split_parents = {parent_name(name) for name, style in entries.items() if is_colwise(style)}
    split_parents -= {name for name, _ in find_blocks(model)} | {""}
    widths = {parent: colwise_inputs(model, entries, parent) for parent in sorted(split_parents)}
    down = down_projections(model, entries, widths)
    heads = {count for count in (facts.num_attention_heads, facts.num_key_value_heads) if count is not None}
    per_feature = per_feature_owners(model, entries, sorted(split_parents), heads)
    partial = [name for name in partial_gradients(model, entries, widths) if name not in per_feature]
    entries.update(dict.fromkeys(per_feature, "per_head_params"))
    entries.update(dict.fromkeys(partial, "replicated_with_grad_allreduce"))
    entries.update(dict.fromkeys(down, "down_projection"))
    plan.sources.update(dict.fromkeys(partial, "partial_gradient"))
    plan.sources.update(dict.fromkeys(per_feature, "per_feature"))
    plan.sources.update(dict.fromkeys(down, "down_projection"))


def _sequence_parallel(plan: _Resolution) -> None:
    """Under SP, the residual norms are split on the sequence; without it, no ``sequence_parallel`` entry stays."""
    if plan.sequence_parallel:
        norms = [name for name in _residual_norms(plan.model) if name not in plan.entries]
        plan.entries.update(dict.fromkeys(norms, "sequence_parallel"))
        plan.sources.update(dict.fromkeys(norms, "sequence_parallel"))
    else:
        plan.entries = {name: style for name, style in plan.entries.items() if style != "sequence_parallel"}


def _checks(plan: _Resolution) -> None:
    """Sizes against tp, and what SP cannot follow."""
    check_plan(plan.model, plan.entries, plan.tp, plan.facts)
    check_fused_heads(plan.model, plan.entries, plan.tp)
    if not plan.sequence_parallel:
        return
    # a state-space mixer's layers are read from its own shape, not from the block's: SP follows the block's norms
    if plan.kind == "pattern" and (inferred := [name for name in plan.structural if name not in plan.mixers]):
        raise ValueError(f"`NDParallel(sequence_parallel=True)` with a plan inferred from the blocks' structure"
                         f" (`{inferred[0]}`, ...): the structure does not show where the model adds its"
                         " residual stream or normalizes it (BERT's post-norms sit inside its attention and MLP"
                         " modules), which the sequence split must follow. HINT: sequence_parallel=False, or pass"
                         " `NDParallel(tp_plan=...)` naming every split layer and residual norm.")
    if stacked := [name for name, style in plan.entries.items() if style in STACKED_STYLES]:
        raise ValueError(f"`NDParallel(sequence_parallel=True)`: `{stacked[0]}` (experts stored as one weight, JetMoE's)"
                         " is split over tp on tokens every tp rank routes whole; with the sequence split its router"
                         " would see a shard. HINT: sequence_parallel=False for this model.")
    if experts := [name for name, style in plan.entries.items() if style == "transposed_experts"]:
        raise ValueError(f"`NDParallel(sequence_parallel=True)`: `{experts[0]}` (transposed_experts, Llama 4's) is"
                         " split over tp on tokens every tp rank holds whole; with the sequence split the block's"
                         " router would see a shard. HINT: sequence_parallel=False for this model.")


PASSES: tuple[tuple[str, Callable[[_Resolution], None]], ...] = (
    ("source", _source),
    ("names", _names),
    ("structure", _structure),
    ("splits something", _splits_something),
    ("keep whole", _keep_whole),
    ("per-head outputs", _per_head_outputs),
    ("wrong splits", _wrong_splits),
    ("beside the split layers", _beside_split_layers),
    ("sequence parallel", _sequence_parallel),
    ("checks", _checks),
)
"""The plan's passes, in the order they run: each reads what the ones before it left."""


def resolve_tp_plan(
    model: nn.Module,
    explicit: Mapping[str, object] | None,
    *,
    tp: int,
    facts: ModelFacts,
    sequence_parallel: bool,
) -> TPPlan:
    """Pick the plan source, expand it to concrete modules, add norms for SP, and check it against tp."""
    plan = _Resolution(model, explicit, tp, facts, sequence_parallel)
    for _, run in PASSES:
        run(plan)
    return TPPlan(plan.entries, plan.source, {name: plan.sources[name] for name in plan.entries})


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
