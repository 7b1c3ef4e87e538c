"""Where a tensor-parallel plan comes from, in order: the user's explicit plan > the plan the model
declares (Hugging Face ``_tp_plan`` / ``config.base_model_tp_plan``) > name-pattern auto-detection.

A plan maps module-name patterns (``*`` matches one name component, as in ``layers.*.q_proj``) to a
style name. The resolved plan names concrete modules and is checked against ``tp`` before any
weight is touched.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from lightning_nd.layout.declared import declared_plan, expand
from lightning_nd.layout.hf_styles import experts_modules, hf_meaning
from lightning_nd.layout.latent import colwise_inputs, down_projections, feeds_colwise
from lightning_nd.layout.structure import (
    ModelFacts,
    find_blocks,
    get_submodule,
    is_linear,
    is_norm,
    linear_names,
    parent_name,
)
from lightning_nd.layout.tp_checks import (
    check_no_fused_attention,
    check_partners,
    check_per_head_outputs,
    check_plan,
    check_three_equal_parts,
    is_colwise,
    unequal_parts,
    vocabulary_split_with_own_forward,
)

log = logging.getLogger(__name__)

STYLES = (
    "colwise",
    "rowwise",
    "packed_colwise",
    "packed_qkv",
    "colwise_rep",
    "rowwise_split_input",
    "embedding_rowwise",
    "embedding_colwise",
    "colwise_gather_output",
    "sequence_parallel",
    "replicated_with_grad_allreduce",
    "mla_kv_a_proj",
    "down_projection",
    "per_head_params",
    "replicate",
)
SHARDING_STYLES = ("colwise", "rowwise", "packed_colwise", "packed_qkv", "colwise_rep", "rowwise_split_input")
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
            outer_only = style in ("embedding_rowwise", "colwise_gather_output")
            kind_ok = isinstance(module, nn.Embedding) if style == "embedding_rowwise" else is_linear(module)
            if kind_ok and not (outer_only and inside(name)):
                plan[name] = style
    return plan


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
        completion = _completion(model, entries)
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
    check_no_fused_attention(model, entries)
    if kind == "pattern":  # a guessed fused [q; k; v] of another shape (multi-query) is left out, with its partner
        entries = _paired({name: style for name, style in entries.items()
                           if style != "packed_qkv" or not unequal_parts(get_submodule(model, name))})
    check_three_equal_parts(model, entries)
    splits_experts = kind == "declared" and bool(experts_modules(model))  # split over tp by the layout itself
    if not splits_experts and not any(not isinstance(style, str) or style in SHARDING_STYLES for style in entries.values()):
        raise ValueError(_no_plan_message(model, tp, declared=kind == "declared"))
    entries = _drop_extended_embeddings(model, _drop_tied(model, entries))
    check_partners(entries, source)
    check_per_head_outputs(model, entries, facts, source)
    sources = {name: origin[name] for name in entries}
    split_parents = {parent_name(name) for name, style in entries.items() if is_colwise(style)}
    split_parents -= {name for name, _ in find_blocks(model)} | {""}
    widths = {parent: colwise_inputs(model, entries, parent) for parent in sorted(split_parents)}
    down = down_projections(model, entries, widths)
    partial = _partial_gradients(model, entries, widths)
    entries.update(dict.fromkeys(partial, "replicated_with_grad_allreduce"))
    entries.update(dict.fromkeys(down, "down_projection"))
    sources.update(dict.fromkeys(partial, "partial_gradient"))
    sources.update(dict.fromkeys(down, "down_projection"))
    if sequence_parallel:
        norms = [name for name in _residual_norms(model) if name not in entries]
        entries.update(dict.fromkeys(norms, "sequence_parallel"))
        sources.update(dict.fromkeys(norms, "sequence_parallel"))
    else:
        entries = {name: style for name, style in entries.items() if style != "sequence_parallel"}
    check_plan(model, entries, tp, facts)
    return TPPlan(entries, source, {name: sources[name] for name in entries})


def _completion(model: nn.Module, declared: Mapping[str, object]) -> dict[str, object]:
    """What name patterns split that a declared plan leaves out (transformers declares only the embedding for
    Bamba, only the experts for Jamba or PhiMoE): paired feed-forward layers (`MLP_NAMES`) in modules the declared
    plan names nothing in and whose other layers are not attention (an attention's ``gate_proj`` is not an MLP's),
    outside experts modules (the layout splits those over tp itself)."""
    experts = experts_modules(model)
    claimed = {parent_name(name) for name in declared}
    guessed = _paired(pattern_plan(model))
    mixed = {parent_name(name) for name in guessed if name.rsplit(".", 1)[-1] not in MLP_NAMES}
    return {name: style for name, style in guessed.items()
            if name not in declared and parent_name(name) not in claimed | mixed
            and not any(name == e or name.startswith(e + ".") for e in experts)}


def _partial_gradients(model: nn.Module, entries: Mapping[str, object], widths: Mapping[str, set[int]]) -> list[str]:
    """Unplanned modules with parameters inside an attention or MLP module whose layers the plan splits (Qwen3-VL-MoE's
    per-head ``q_norm``/``k_norm``, Apertus' xIELU ``act_fn`` with its two scalars): they work on one tp rank's heads
    or features, so each rank's gradient of their (whole) parameters is a part, summed over tp
    (``replicated_with_grad_allreduce``). ``widths``: the modules the plan splits, not blocks (a block's own norms
    see the whole residual stream), each with its colwise layers' input widths. A norm in front of a colwise layer (MLA's ``kv_a_layernorm``,
    `lightning_nd.layout.latent`) sees the whole latent and is left whole."""
    found = []
    for parent, inputs in widths.items():
        for child, module in get_submodule(model, parent).named_modules():
            name = f"{parent}.{child}"
            if (child and name not in entries and not is_linear(module) and not isinstance(module, nn.Embedding)
                    and not any(name.startswith(entry + ".") for entry in entries)
                    and any(True for _ in module.parameters(recurse=False))
                    and not (parent_name(name) == parent and feeds_colwise(module, inputs))):
                found.append(name)
    if found:
        log.info("Parameters seeing one tp rank's heads or features, their gradients summed over tp: %s", ", ".join(found))
    return found


def _paired(entries: Mapping[str, object]) -> dict[str, object]:
    """Name patterns guess; a guessed colwise layer without its rowwise partner (or the reverse) is left out."""
    sides: dict[str, set[str]] = {}
    for name, style in entries.items():
        if is_colwise(style) or style == "rowwise":
            sides.setdefault(parent_name(name), set()).add("colwise" if is_colwise(style) else "rowwise")
    alone = {name for name, style in entries.items()
             if (is_colwise(style) or style == "rowwise") and len(sides[parent_name(name)]) == 1}
    if alone:
        log.info("Left out of the tp plan, found without a colwise/rowwise partner: %s", ", ".join(sorted(alone)))
    return {name: style for name, style in entries.items() if name not in alone}


def _drop_tied(model: nn.Module, entries: Mapping[str, object]) -> dict[str, object]:
    """A module whose weight is shared (a head tied to the embedding) stays replicated under TP:
    sharding it would replace the shared parameter in one module only and silently untie it."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(parent_name(name))
    shared = {owner for names in owners.values() if len(names) > 1 for owner in names}
    tied = sorted(name for name in entries if name in shared)
    if tied:
        log.info("Tied weights stay replicated under TP: %s", ", ".join(tied))
    return {name: style for name, style in entries.items() if name not in shared}


def _drop_extended_embeddings(model: nn.Module, entries: dict[str, object]) -> dict[str, object]:
    """An embedding whose own forward works on the looked-up rows stays replicated under TP (see
    `vocabulary_split_with_own_forward`); the rest of the plan applies."""
    extended = vocabulary_split_with_own_forward(model, entries)
    if extended:
        log.info("Embeddings whose forward works on the looked-up rows stay replicated under TP: %s", ", ".join(extended))
    return {name: style for name, style in entries.items() if name not in extended}


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


def _no_plan_message(model: nn.Module, tp: int, declared: bool) -> str:
    linears = linear_names(model)
    if declared:
        return (f"`NDParallel(tp={tp})`: the plan `{type(model).__name__}` declares (`base_model_tp_plan`) splits no"
                f" weight matrix, only embeddings or norms. HINT: pass `NDParallel(tp_plan=...)` naming its"
                f" attention and MLP layers ('colwise' in, 'rowwise' out), e.g. {_suggest_plan(model)}.")
    suggestion = _suggest_plan(model)
    listing = "\n".join(f"    {name}" for name in linears) or "    (none)"
    return (
        f"`NDParallel(tp={tp})` found no tensor-parallel plan for `{type(model).__name__}`: it declares none"
        f" (`_tp_plan`) and none of its linear layers has a known name ({', '.join(NAME_PATTERNS['colwise'][:6])}, ...)."
        f"\n  Linear layers:\n{listing}\n"
        f"  HINT: pass a plan, e.g. `NDParallel(tp={tp}, tp_plan={suggestion})`: 'colwise' for a layer that"
        " fans out of the residual stream, 'rowwise' for the one that comes back into it."
    )


def _suggest_plan(model: nn.Module) -> dict[str, str]:
    blocks = find_blocks(model)
    if not blocks:
        return {name: "colwise" for name in linear_names(model)[:1]}
    first_name, first = blocks[0]
    pattern_prefix = first_name.rsplit(".", 1)[0] + ".*." if "." in first_name else "*."
    plan = {}
    for name, module in first.named_modules():
        if isinstance(module, nn.Linear):
            fans_out = module.out_features >= module.in_features
            plan[pattern_prefix + name] = "colwise" if fans_out else "rowwise"
    return plan
