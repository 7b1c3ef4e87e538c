"""Layers a tp plan keeps whole in front of a colwise layer (which families:
tests/distributed/family_rules.py): a low-rank latent of the attention's input, normalised, then expanded per head.

E.g. multi-head latent attention: ``q_a_proj`` and ``kv_a_proj_with_mqa`` (and their norms) stay whole, ``q_b_proj``
and ``kv_b_proj`` are colwise. The whole layers see the full latent on every tp rank and get a whole gradient back
(the colwise layer after them sums its input gradient over tp), so their gradients are not summed again; they are
told apart from per-head layers (a ``q_norm`` after a colwise layer, whose gradients are summed) by width: their
output is the input width of a colwise sibling. The exception is a shared rotary key, the last ``qk_rope_head_dim``
outputs of ``kv_a_proj_with_mqa``, which goes to every head directly (`rope_dim`).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from lightning_nd.model.structure import get_submodule, is_linear, is_norm, parent_name
from lightning_nd.tensor_parallel.infer.checks import is_colwise

ROPE_ATTRS = ("qk_rope_head_dim",)
"""Where an MLA attention module (or its ``config``) keeps the width of its shared rotary key."""


def rope_dim(model: nn.Module, name: str) -> int | None:
    """The shared rotary key's width for ``mla_kv_a_proj`` on ``name``: read from its attention module."""
    parent = get_submodule(model, parent_name(name))
    for holder in (parent, getattr(parent, "config", None)):
        for attr in ROPE_ATTRS:
            value = getattr(holder, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def colwise_inputs(model: nn.Module, entries: Mapping[str, object], parent: str) -> set[int]:
    """The input widths of the colwise layers directly below ``parent``, and half of one where an unplanned linear
    sibling writes that half and a norm sibling has it: a latent read concatenated with its own norm (AXK2's
    ``q_gate_proj`` reads ``cat([q_a_layernorm(q), q])`` of ``q = q_a_proj(x)``)."""
    widths = set()
    for name, style in entries.items():
        if parent_name(name) == parent and is_colwise(style):
            width = getattr(get_submodule(model, name), "in_features", None)
            if isinstance(width, int):
                widths.add(width)
    children = dict(get_submodule(model, parent).named_children())
    written = {getattr(layer, "out_features", None) for child, layer in children.items()
               if is_linear(layer) and (f"{parent}.{child}" if parent else child) not in entries}
    normed = {param.shape[-1] for layer in children.values() if is_norm(layer)
              for param in layer.parameters(recurse=False) if param.ndim == 1}
    return widths | {width // 2 for width in widths if width % 2 == 0 and width // 2 in written & normed}


def feeds_colwise(module: nn.Module, widths: set[int]) -> bool:
    """A norm or linear layer whose output has the input width of a colwise sibling (and not its own input width):
    a latent's down projection or norm, whole before the per-head split."""
    if is_linear(module):
        return module.out_features in widths and module.out_features != module.in_features
    sizes = {param.shape[-1] for param in module.parameters(recurse=False) if param.ndim == 1}
    return len(sizes) == 1 and sizes <= widths


def down_projections(model: nn.Module, entries: Mapping[str, object], widths: Mapping[str, set[int]]) -> list[str]:
    """Unplanned layers below the modules of ``widths`` (attention or MLP modules the plan splits, not blocks,
    each with its `colwise_inputs`) that read the shared input for a colwise sibling: a linear layer compressing it
    (MLA's ``q_a_proj``), or a norm of the input's own width when no sibling projects to it (a pre-norm inside the
    MLP module, RoBERTa-PreLayerNorm's ``intermediate.LayerNorm``): ``down_projection``."""
    found = []
    for parent, inputs in widths.items():
        children = dict(get_submodule(model, parent).named_children())
        projected = {module.out_features for module in children.values() if is_linear(module)
                     and isinstance(getattr(module, "out_features", None), int)}
        for child, module in children.items():
            name = f"{parent}.{child}"
            reads_input = not is_linear(module) and is_norm(module) and not (inputs & projected)
            if name not in entries and (is_linear(module) or reads_input) and feeds_colwise(module, inputs):
                found.append(name)
    return found
