"""What a tp plan leaves whole on every tp rank, and why: tied weights (splitting one owner would untie them),
embeddings whose own forward works on the looked-up rows, vocabularies tp does not divide, and modules whose split
the model shows to be wrong (a norm over the split features, a reshape with the input's width). A declared or
guessed entry is dropped with a log line; an explicit (or, for wrong splits, declared) one is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from lightning_nd.model.structure import find_blocks, get_submodule, parent_name
from lightning_nd.tensor_parallel.infer.checks import (
    head_counts,
    is_colwise,
    norms_over_split_features,
    vocabulary_split_with_own_forward,
)
from lightning_nd.tensor_parallel.infer.forward_source import reshapes_with_input_width
from lightning_nd.tensor_parallel.infer.fused_heads import norms_over_all_heads
from lightning_nd.tensor_parallel.styles import style_has

log = logging.getLogger("lightning_nd.tensor_parallel.infer.resolve")


def wrong_splits(model: nn.Module, entries: Mapping[str, object]) -> dict[str, str]:
    """Modules whose split the model shows to be wrong: module -> why."""
    norms = {**norms_over_split_features(model, entries), **norms_over_all_heads(model, entries)}
    over = {parent: f"`{norm}` normalizes the features `{parent or 'the model'}` splits over tp, so each rank would"
                    " normalize its own part of them" for parent, norm in norms.items()}
    blocks = {name for name, _ in find_blocks(model)}
    for parent in sorted({parent_name(name) for name, style in entries.items() if is_colwise(style)} - blocks):
        module = get_submodule(model, parent)
        if head_counts(module) and (line := reshapes_with_input_width(module)):  # split by heads
            over[parent] = (f"`{parent}` takes its width from its input (`{line}`) and reshapes its split output with"
                            " it, which has the width / tp")
    return over


def leave_whole(entries: dict[str, object], origin: Mapping[str, str], over: Mapping[str, str],
                 source: str) -> dict[str, object]:
    """Modules whose split the model shows to be wrong (``over``: module -> why): refused when an explicit or declared
    entry splits them, else left whole on every tp rank with a warning."""
    for parent, why in over.items():
        if any(parent_name(name) == parent and origin.get(name) in ("explicit", "declared") for name in entries):
            raise ValueError(f"TP plan ({source}): {why}. HINT: pass `NDParallel(tp_plan=...)` that leaves"
                             f" `{parent or 'that module'}` out (it then stays whole on every tp rank).")
    if over:
        log.warning("Left whole on every tp rank, modules a guessed split would get wrong: %s",
                    "; ".join(f"{parent}: {why}" for parent, why in over.items()))
    return {name: style for name, style in entries.items() if parent_name(name) not in over and name not in over}


def drop_tied(model: nn.Module, entries: Mapping[str, object]) -> dict[str, object]:
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


def drop_extended_embeddings(model: nn.Module, entries: dict[str, object]) -> dict[str, object]:
    """An embedding whose own forward works on the looked-up rows stays replicated under TP (see
    `vocabulary_split_with_own_forward`); the rest of the plan applies."""
    extended = vocabulary_split_with_own_forward(model, entries)
    if extended:
        log.info("Embeddings whose forward works on the looked-up rows stay replicated under TP: %s",
                 ", ".join(extended))
    return {name: style for name, style in entries.items() if name not in extended}


def drop_indivisible_vocabulary(model: nn.Module, entries: dict[str, object], tp: int) -> dict[str, object]:
    """An embedding or output head of a declared or guessed plan whose vocabulary tp does not divide (Moshi's 129
    rows) stays whole on every tp rank; the rest of the plan applies. (An explicit plan naming it is refused.)"""
    dropped = sorted(name for name, style in entries.items() if style_has(style, outer=True)
                     and (size := _vocabulary(get_submodule(model, name), style)) is not None and size % tp)
    if dropped:
        log.warning("tp=%d does not divide the vocabulary of %s: left whole on every tp rank.", tp, ", ".join(dropped))
    return {name: style for name, style in entries.items() if name not in dropped}


def _vocabulary(module: nn.Module, style: object) -> int | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        return None
    return weight.shape[1] if style == "embedding_colwise" else weight.shape[0]
