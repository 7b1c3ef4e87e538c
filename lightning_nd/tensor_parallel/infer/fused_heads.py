"""A fused ``[q; k; v]`` projection whose parts are sized by head counts, split by heads (which families:
tests/unit/test_tp_fused_heads.py).

LitGPT's attention holds one ``qkv`` linear of ``(n_head + 2 * n_query_groups) * head_size`` outputs, queries then
keys then values (unequal under grouped-query attention), splits its output with ``qkv.split((q, k, v sizes))``
and reads the counts from its ``config``. Such a module is recognised where:

- it (or its ``config``) names its query heads, key/value heads and head width (`head_layout`);
- its linear layers are the fused one, of ``(heads + 2 * groups) * head_dim`` outputs, and one output projection
  from ``heads * head_dim`` back to the fused layer's input width;
- its forward splits the fused layer's output into three (`forward_source.splits_in_three`), which is the part by
  part order (a head by head one, GPT-NeoX's ``query_key_value``, is viewed per head instead).

The fused layer is ``packed_heads``, its output projection ``rowwise_packed_heads``. How they are applied, and why
each rank's heads read keys and values gathered over tp: `lightning_nd/tensor_parallel/apply/packed_heads.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from lightning_nd.mesh.dims import divisors
from lightning_nd.model.structure import HEAD_ATTRS, KV_HEAD_ATTRS, find_blocks, get_submodule, is_norm, parent_name
from lightning_nd.tensor_parallel.infer.checks import HEAD_DIM_ATTRS
from lightning_nd.tensor_parallel.infer.forward_source import splits_in_three
from lightning_nd.tensor_parallel.styles import style_has

GROUP_ATTRS = (*KV_HEAD_ATTRS, "n_query_groups")
"""Where a module (or its ``config``) keeps its key/value head count; LitGPT calls them query groups."""


@dataclass(frozen=True)
class HeadLayout:
    """The head counts a module reshapes its fused projection's output with, and where it reads them."""

    heads: int
    groups: int
    head_dim: int
    holder: str
    """``config`` when the module reads them from its ``config``, else empty (its own attributes)."""
    attrs: tuple[str, str]
    """The names of the query and key/value head counts on the holder."""

    @property
    def parts(self) -> tuple[int, int, int]:
        """The widths of the queries, keys and values."""
        return self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim

    def where(self, module_name: str, attr: str) -> str:
        return ".".join(part for part in (module_name, self.holder, attr) if part)


def head_layout(module: nn.Module) -> HeadLayout | None:
    """The module's query heads, key/value heads (its query heads when it names none) and head width, read from the
    first of the module and its ``config`` that names its query heads; None when neither does."""
    for holder, source in (("", module), ("config", getattr(module, "config", None))):
        heads = _first(source, HEAD_ATTRS)
        if heads is None:
            continue
        groups, head_dim = _first(source, GROUP_ATTRS) or heads, _first(source, HEAD_DIM_ATTRS)
        if head_dim is None:
            return None
        return HeadLayout(heads[1], groups[1], head_dim[1], holder, (heads[0], groups[0]))
    return None


def _first(source: object, attrs: tuple[str, ...]) -> tuple[str, int] | None:
    for attr in attrs:
        value = getattr(source, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return attr, value
    return None


def fused_heads_plan(model: nn.Module, planned: Mapping[str, object]) -> dict[str, str]:
    """``packed_heads`` and ``rowwise_packed_heads`` for each module inside a block that the rules above recognise
    and ``planned`` leaves out."""
    plan: dict[str, str] = {}
    for block_name, block in find_blocks(model):
        for child, module in block.named_modules():
            name = f"{block_name}.{child}"
            if child and not any(entry == name or entry.startswith(name + ".") for entry in planned):
                plan.update(_fused_pair(name, module))
    return plan


def _fused_pair(name: str, module: nn.Module) -> dict[str, str]:
    layout = head_layout(module)
    linears = {child: layer for child, layer in module.named_children() if isinstance(layer, nn.Linear)}
    if layout is None or len(linears) != 2:
        return {}
    query, key, value = layout.parts
    fused = [child for child, layer in linears.items() if layer.out_features == query + key + value]
    output = [child for child, layer in linears.items() if layer.in_features == query and child not in fused]
    if len(fused) != 1 or len(output) != 1:
        return {}
    if linears[output[0]].out_features != linears[fused[0]].in_features or not splits_in_three(module, fused[0]):
        return {}
    return {f"{name}.{fused[0]}": "packed_heads", f"{name}.{output[0]}": "rowwise_packed_heads"}


def check_fused_heads(model: nn.Module, entries: Mapping[str, object], tp: int) -> None:
    """A ``packed_heads`` layer needs its module's head counts, its width to be theirs, and tp to divide both counts:
    a multi-query attention (one key/value head) is refused, its keys and values cannot be split by heads."""
    for name, style in entries.items():
        if not style_has(style, by_heads=True):
            continue
        parent = parent_name(name)
        layout = head_layout(get_submodule(model, parent))
        if layout is None:
            raise ValueError(f"TP plan: `{name}` is {style}, but `{parent or 'the model'}` names no head counts (on"
                             f" itself or its `config`: one of {HEAD_ATTRS}, of {GROUP_ATTRS} and of"
                             f" {HEAD_DIM_ATTRS}). HINT: leave `{parent or name}` out of `NDParallel(tp_plan=...)`.")
        layer = get_submodule(model, name)
        expected = sum(layout.parts) if style == "packed_heads" else layout.parts[0]
        width = getattr(layer, "out_features" if style == "packed_heads" else "in_features", None)
        if not isinstance(layer, nn.Linear) or width != expected:
            raise ValueError(f"TP plan: `{name}` is {style}, an `nn.Linear` of {expected} features by the head counts"
                             f" of `{parent}` ({layout.heads} heads, {layout.groups} key/value heads of"
                             f" {layout.head_dim}), but it is a {type(layer).__name__} of {width}. HINT: leave"
                             f" `{parent}` out of `NDParallel(tp_plan=...)`.")
        for attr, count in zip(layout.attrs, (layout.heads, layout.groups)):
            if count % tp:
                raise ValueError(
                    f"`NDParallel(tp={tp})` does not divide `{layout.where(parent, attr)}={count}`: `{name}`'s heads"
                    f" would be split mid-head (one key/value head shared by all query heads is not split or"
                    f" copied). HINT: choose tp from {divisors(count)}, or keep the attention whole on every tp rank:"
                    f" `NDParallel(tp={tp}, tp_plan={_without_fused_heads(model, entries)})`.")


def _without_fused_heads(model: nn.Module, entries: Mapping[str, object]) -> dict[str, object]:
    """The plan without the modules split by head counts, as patterns (``*`` for the block number)."""
    blocks = find_blocks(model)
    first = blocks[0][0] if blocks else ""
    split = {parent_name(name) for name, style in entries.items() if style_has(style, by_heads=True)}
    plan: dict[str, object] = {}
    for name, style in entries.items():
        in_block = any(name.startswith(block + ".") for block, _ in blocks)
        if isinstance(style, str) and parent_name(name) not in split and (not in_block or name.startswith(first + ".")):
            plan[f"{parent_name(first)}.*.{name[len(first) + 1:]}" if in_block else name] = style
    return plan


def norms_over_all_heads(model: nn.Module, entries: Mapping[str, object]) -> dict[str, str]:
    """Norms beside a ``packed_heads`` layer over all heads' queries or keys (OLMo 2's ``norm_q`` of
    ``n_head * head_size``): each tp rank would normalize its own heads only. Module -> that norm."""
    found: dict[str, str] = {}
    for name, style in entries.items():
        parent = parent_name(name)
        layout = head_layout(get_submodule(model, parent)) if style == "packed_heads" else None
        if layout is None:
            continue
        whole = set(layout.parts) - {layout.head_dim}  # one head's width: a per-head norm, split with the heads
        for child, module in get_submodule(model, parent).named_children():
            sizes = {param.shape[0] for param in module.parameters(recurse=False) if param.ndim == 1}
            if is_norm(module) and sizes & whole:
                found.setdefault(parent, f"{parent}.{child}")
    return found
