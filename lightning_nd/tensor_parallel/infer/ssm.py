"""Recurrent mixers recognised by their shapes and split by channels (which families:
tests/distributed/family_rules.py).

A selective state-space mixer is a module with a depthwise ``nn.Conv1d`` over I channels, one linear layer H -> 2I
(inputs and gates, ``packed_colwise``), one I -> H (rowwise), layers reading the I channels into something narrower
(``rowwise_shared_output``) or writing them (``channel_params``), and own parameters with one row per channel;
anything else in the module leaves it whole. E.g. Mamba's ``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``,
``out_proj``, ``A_log`` and ``D``; applied by `lightning_nd.tensor_parallel.apply.ssm_channels`.

An RWKV-style mixer (an attention without heads) splits its key/value/receptance colwise and output rowwise, with
its per-channel recurrence vectors (``per_channel_vectors``); it mixes its input with its shifted self through whole
``[1, 1, H]`` weights, so it takes a plain input.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from torch import nn

from lightning_nd.model.structure import is_linear, is_norm, owns_parameters, widths


def selective_scan_plan(model: nn.Module, planned: Mapping[str, object]) -> dict[str, str]:
    """Plan entries for every unplanned mixer of the model (none where nothing matches)."""
    entries: dict[str, str] = {}
    for name, module in model.named_modules():
        if any(entry == name or entry.startswith(name + ".") or name.startswith(entry + ".")
               for entry in (*planned, *entries) if entry):
            continue
        styles = _mixer_styles(module) or _time_mix_styles(module) or _channel_mix_styles(module)
        if styles:
            entries.update({f"{name}.{child}" if child else name: style for child, style in styles.items()})
    return entries


def _mixer_styles(module: nn.Module) -> dict[str, str] | None:
    children = dict(module.named_children())
    convs = [child for child, layer in children.items() if isinstance(layer, nn.Conv1d)
             and layer.groups == layer.in_channels == layer.out_channels > 1]
    if len(convs) != 1:
        return None
    inner = cast(nn.Conv1d, children[convs[0]]).in_channels
    linears = {child: widths(layer) for child, layer in children.items() if is_linear(layer)}
    ins = [child for child, (reads, writes) in linears.items() if writes == 2 * inner and reads != inner]
    outs = [child for child, (reads, writes) in linears.items() if reads == inner and ins
            and writes == linears[ins[0]][0]]
    if len(ins) != 1 or len(outs) != 1:
        return None
    styles = {"": "channel_mixer", convs[0]: "channel_params", ins[0]: "packed_colwise", outs[0]: "rowwise"}
    for child, (reads, writes) in linears.items():
        if child in styles:
            continue
        if reads == inner and writes < inner:
            styles[child] = "rowwise_shared_output"
        elif writes == inner and reads < inner:
            styles[child] = "channel_params"
        else:
            return None
    others = [layer for child, layer in children.items() if child not in styles and owns_parameters(layer)]
    if any(not is_norm(layer) for layer in others):
        return None
    if any(param.shape[0] != inner for param in module.parameters(recurse=False)):
        return None
    return styles


def _time_mix_styles(module: nn.Module) -> dict[str, str] | None:
    """RWKV's time mixing: linear layers H -> A (key, value, receptance) registered before one A -> H (output), the
    recurrence run channel by channel with per-channel vectors of length A (``time_decay``, ``time_first``: split),
    and ``[1, 1, H]`` weights mixing the input with its shifted self (whole)."""
    linears = {child: widths(layer) for child, layer in module.named_children() if is_linear(layer)}
    if len(linears) < 2:
        return None
    *fans, back = linears
    inner, hidden = linears[back]
    if any(linears[fan] != (hidden, inner) for fan in fans) or _other_children(module, linears):
        return None
    vectors = [param for param in module.parameters(recurse=False) if param.ndim == 1]
    if not vectors or any(param.shape[0] != inner for param in vectors) or not _input_weights(module, hidden):
        return None
    return {"": "per_channel_vectors", **dict.fromkeys(fans, "colwise"), back: "rowwise"}


def _channel_mix_styles(module: nn.Module) -> dict[str, str] | None:
    """RWKV's channel mixing: one linear layer H -> I (key) and one I -> H (value), a gate H -> H (receptance, whole)
    and ``[1, 1, H]`` input-mixing weights (whole)."""
    linears = {child: widths(layer) for child, layer in module.named_children() if is_linear(layer)}
    gates = [child for child, (reads, writes) in linears.items() if reads == writes]
    pairs = [child for child in linears if child not in gates]
    if len(pairs) != 2 or _other_children(module, linears) or any(
            param.ndim == 1 for param in module.parameters(recurse=False)):
        return None
    (up, (hidden, inner)), (down, back) = ((name, linears[name]) for name in pairs)
    if back != (inner, hidden) or inner == hidden or any(linears[gate][0] != hidden for gate in gates):
        return None
    return {up: "colwise", down: "rowwise"} if _input_weights(module, hidden) else None


def _other_children(module: nn.Module, linears: Mapping[str, object]) -> bool:
    return any(owns_parameters(layer) for child, layer in module.named_children() if child not in linears)


def _input_weights(module: nn.Module, hidden: int) -> bool:
    """Weights of the input's width mixing it before the projections (``[1, 1, H]``): at least one, and nothing else."""
    weights = [param for param in module.parameters(recurse=False) if param.ndim > 1]
    return bool(weights) and all(param.shape[-1] == hidden and param.numel() == hidden for param in weights)
