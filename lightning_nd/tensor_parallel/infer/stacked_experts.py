"""Experts stored as one ``[E, out, in]`` weight per layer (JetMoE's ``ParallelExperts``), recognised by shape and
split over tp as linear layers (`lightning_nd.tensor_parallel.apply.stacked_experts`).

A module with two such children, the first ``[E, O, H]`` and the second ``[E, H, O']`` of the same E and H, is a
mixture: of MLPs when O = 2 O' (``[gate; up]``: ``stacked_packed_colwise``, then ``stacked_rowwise``), of attention
heads when O = O' (JetMoE's MoA: each expert a query projection for the shared key/value heads; ``stacked_colwise``,
then ``stacked_rowwise``, and the attention's ``[k; v]`` projection H -> 2 O beside it ``packed_colwise``). Under
tp each rank then holds O / tp of every expert's features: for the MoA, its share of the key/value heads.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from lightning_nd.model.structure import is_experts, is_linear, parent_name, widths


def stacked_experts_plan(model: nn.Module, planned: Mapping[str, object]) -> dict[str, str]:
    """Plan entries for every unplanned mixture of stacked experts (none where nothing matches)."""
    entries: dict[str, str] = {}
    modules = dict(model.named_modules())
    for name, module in modules.items():
        prefix = f"{name}." if name else ""
        if any(entry == name or entry.startswith(prefix) or name.startswith(entry + ".") for entry in planned if entry):
            continue
        stacks = [(child, layer.weight.shape) for child, layer in module.named_children() if _stacked(layer)]
        if len(stacks) != 2:
            continue
        (first, (experts, out, hidden)), (second, (experts2, hidden2, inner)) = stacks
        if (experts, hidden) != (experts2, hidden2):
            continue
        if out == 2 * inner:
            entries.update({prefix + first: "stacked_packed_colwise", prefix + second: "stacked_rowwise"})
        elif out == inner and name:
            owner = parent_name(name)
            kv = [child for child, layer in modules[owner].named_children()
                  if is_linear(layer) and widths(layer) == (hidden, 2 * out)] if owner in modules else []
            if len(kv) == 1:
                entries.update({prefix + first: "stacked_colwise", prefix + second: "stacked_rowwise",
                                f"{owner}.{kv[0]}" if owner else kv[0]: "packed_colwise"})
    return entries


def _stacked(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    return (set(params) == {"weight"} and params["weight"].ndim == 3 and not is_experts(module)
            and not any(True for _ in module.children()))
