"""Selective state-space mixers (Mamba, Falcon-Mamba, Jamba's Mamba layers) recognised by their shapes, split by
channels (`lightning_nd.parallel.tp_channels`).

A mixer is a module with a depthwise ``nn.Conv1d`` over I channels, one linear layer H -> 2I (``in_proj``: the
channels' inputs and gates, ``packed_colwise``), one I -> H (``out_proj``, rowwise), linear layers reading the I
channels into something narrower (``x_proj``: ``rowwise_shared_output``), linear layers writing I channels from
something else (``dt_proj``: ``channel_params``), and own parameters with one row per channel (``A_log``, ``D``).
Norms on ``x_proj``'s outputs (Jamba's ``dt_layernorm``) stay whole, their gradients summed over tp like any
per-rank use of a whole parameter. Anything else in the module (another layer, a parameter of another length)
leaves it unrecognised: it stays whole. Mamba-2's mixers (one fused projection of unequal parts, heads) are not
this shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from torch import nn

from lightning_nd.layout.structure import is_linear, is_norm, widths


def selective_scan_plan(model: nn.Module, planned: Mapping[str, object]) -> dict[str, str]:
    """Plan entries for every unplanned mixer of the model (none where nothing matches)."""
    entries: dict[str, str] = {}
    for name, module in model.named_modules():
        if any(entry == name or entry.startswith(name + ".") or name.startswith(entry + ".")
               for entry in (*planned, *entries) if entry):
            continue
        styles = _mixer_styles(module)
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
    others = [layer for child, layer in children.items() if child not in styles and any(True for _ in layer.parameters())]
    if any(not is_norm(layer) for layer in others):
        return None
    if any(param.shape[0] != inner for param in module.parameters(recurse=False)):
        return None
    return styles

