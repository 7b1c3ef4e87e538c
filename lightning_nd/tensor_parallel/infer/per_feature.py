"""Per-head and per-feature state beside the layers a tp plan splits (which families:
tests/distributed/family_rules.py): a module's own vector with one entry per split feature or head is split with
them (`PerHeadParameters`), and so is a linear layer with one output per head.

A module's own vector is per-feature when its length is the full output width of a colwise layer directly below
the module, or a head count; a child's (not a norm: a per-head ``q_norm`` is as wide as one head) when its length is
a head count. E.g. ``gate_proj(x) * suv_gate`` in an MLP: ``suv_gate`` is split as ``gate_proj``'s outputs are. A
wrong guess cannot pass silently: a split vector that scales whole-width values, or a whole one on split values,
fails at its first use on a shape.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from torch import nn

from lightning_nd.model.structure import ModelFacts, get_submodule, is_linear, is_norm, parent_name, widths
from lightning_nd.tensor_parallel.infer.checks import head_counts, is_colwise, tp_split
from lightning_nd.tensor_parallel.infer.mla import feeds_colwise
from lightning_nd.tensor_parallel.styles import style_has

log = logging.getLogger(__name__)


def per_feature_owners(model: nn.Module, entries: Mapping[str, object], parents: Iterable[str],
                       heads: Iterable[int] = ()) -> list[str]:
    """The unplanned ``parents`` (modules the plan splits, not blocks) whose own parameters are all per-feature
    vectors of their colwise layers' outputs or per-head vectors, and their unplanned children (not norms, not
    linear) whose own parameters are all per-head vectors: ``per_head_params``. ``heads``: the config's head
    counts, beside each module's own."""
    found = []
    for parent in parents:
        module = get_submodule(model, parent)
        counts = set(heads) | set(head_counts(module).values())
        if parent not in entries and _all_of(module, counts | split_output_widths(model, entries, parent)):
            found.append(parent)
        found += [f"{parent}.{child}" for child, layer in module.named_children() if f"{parent}.{child}" not in entries
                  and not is_norm(layer) and not is_linear(layer) and _all_of(layer, counts)]
    return found


def _all_of(module: nn.Module, lengths: set[int]) -> bool:
    own = list(module.parameters(recurse=False))
    return bool(own) and all(param.ndim == 1 and param.shape[0] in lengths for param in own)


def split_input_widths(model: nn.Module, entries: Mapping[str, object], parent: str) -> set[int]:
    """The input widths of the colwise layers directly below ``parent``."""
    return {widths(get_submodule(model, name))[0] for name, style in entries.items()
            if parent_name(name) == parent and is_colwise(style)}


def works_on_its_input(model: nn.Module, entries: Mapping[str, object], parent: str) -> bool:
    """``parent`` has weights of its input's width that are not vectors (RWKV's ``[1, 1, H]`` time-mix weights):
    it computes on its whole input before any projection."""
    inputs = split_input_widths(model, entries, parent)
    return any(param.ndim > 1 and param.shape[-1] in inputs and param.numel() == param.shape[-1]
               for param in get_submodule(model, parent).parameters(recurse=False))


def split_output_widths(model: nn.Module, entries: Mapping[str, object], parent: str) -> set[int]:
    """The full output widths of the colwise layers directly below ``parent`` split in one piece (a fused layer's
    parts are laid out part by part, which a vector of its width does not follow)."""
    widths = set()
    for name, style in entries.items():
        if parent_name(name) != parent or not is_colwise(style):
            continue
        layer = get_submodule(model, name)
        split = tp_split(layer, "weight", style)
        weight = getattr(layer, "weight", None)
        if split is not None and split[1] == 1 and weight is not None and weight.ndim == 2:
            widths.add(int(weight.shape[split[0]]))
    return widths


def per_head_outputs(model: nn.Module, entries: Mapping[str, object], facts: ModelFacts, source: str,
                     restyle: bool) -> dict[str, str]:
    """A linear layer with one output per head (``out_features`` equal to a head count), next to layers that split
    the heads, must be split with them: rowwise or unplanned it gives every tp rank the values of all heads while
    the rank holds heads / tp of them (Doge's ``dt_proj``, one dynamic-mask weight per key/value head, added to
    the local heads' scores). With ``restyle`` (a declared or guessed plan) it is split by its outputs: ``colwise``
    when it reads the module's input, ``per_head_rowwise`` when it reads the split heads' features (Doge's, from the
    values); name -> that style. Refused when the plan is explicit or its input width does not tell which."""
    config_counts = {fact: getattr(facts, fact) for fact in ("num_attention_heads", "num_key_value_heads")
                     if getattr(facts, fact) is not None}
    styles = {}
    for parent in sorted({parent_name(name) for name, style in entries.items() if is_colwise(style)}):
        module = get_submodule(model, parent)
        counts = {**config_counts, **head_counts(module)}
        children = {f"{parent}.{child}" if parent else child: layer for child, layer in module.named_children()}
        split = [widths(layer) for name, layer in children.items() if is_colwise(entries.get(name))]
        inputs, outputs = {width[0] for width in split}, {width[1] for width in split}
        for name, layer in children.items():
            if not is_linear(layer) or is_colwise(entries.get(name)):
                continue
            reads, width = widths(layer)
            fact = next((fact for fact, count in counts.items() if count == width), None)
            if fact is None:
                continue
            style = ("colwise" if reads in inputs - outputs
                     else "per_head_rowwise" if reads in outputs - inputs else None)
            if restyle and style is not None:
                styles[name] = style
                continue
            raise ValueError(
                f"TP plan ({source}): `{name}` has one output per head (`out_features={width}` = `{fact}`), but"
                f" `{parent}` splits its heads over tp and `{name}` is {entries.get(name) or 'not in the plan'}:"
                f" every tp rank would get the values of all {width} heads, which no longer match its local"
                f" heads. HINT: {_per_head_fix(name, style)} `NDParallel(tp_plan=...)`, or leave `{parent}` out of it"
                " (e.g. the MLP layers only: unplanned modules stay whole on every tp rank)."
            )
    return styles


def _per_head_fix(name: str, style: str | None) -> str:
    return f"name `{name}` '{style}' in" if style else "pass"


def partial_gradients(model: nn.Module, entries: Mapping[str, object], widths: Mapping[str, set[int]]) -> list[str]:
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
                    and not any(name.startswith(entry + ".") for entry, style in entries.items()
                                if not style_has(style, owns=True))
                    and any(True for _ in module.parameters(recurse=False))
                    and not (parent_name(name) == parent and feeds_colwise(module, inputs))):
                found.append(name)
    if found:
        log.info("Parameters seeing one tp rank's heads or features, their gradients summed over tp: %s", ", ".join(found))
    return found
