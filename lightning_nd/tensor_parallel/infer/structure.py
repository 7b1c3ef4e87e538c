"""Tensor-parallel plans from a model's structure, for the layers of a block that neither a declared plan nor a
known name covers (Bloom's ``dense_h_to_4h``, the BERT family's ``intermediate.dense``, PyTorch's
``nn.TransformerEncoderLayer``'s ``linear1``).

Within each repeated block, the linear layers are read in the order the block registers them, with their
widths against the block's residual width ``H``:

- attention: a module with a head count (``num_heads``, ``num_attention_heads``, ...) whose layers read ``H``
  (q, k, v: one width per head group) is split by heads, colwise; the layer that takes the heads back into ``H``
  is rowwise, whether it sits in that module (Llama's ``o_proj``, Bloom's ``dense``) or is the next layer of
  the block (BERT's ``attention.output.dense``). A fused ``[q; k; v]`` is split only where its name says how its
  rows are ordered (``query_key_value``: head by head, as GPT-NeoX declares it); otherwise the attention stays
  whole.
- feed-forward: a run of layers ``H -> I`` (``I > H``: a bottleneck is left whole) followed by one ``I -> H`` is
  colwise then rowwise, unless a module with parameters of width ``I`` (a norm of the intermediate features) sits
  beside them.

What the rules do not recognise stays whole on every tp rank, and `left_whole` names the large matrices left so.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from lightning_nd.model.structure import HEAD_ATTRS, find_blocks, is_linear, parent_name, widths

FUSED_HEAD_MAJOR = ("query_key_value",)
"""Names of a fused ``[q; k; v]`` laid out head by head (``[heads, 3, head_dim]``): a plain colwise split keeps
each head's q, k and v together."""
LARGE = 0.1
"""A matrix left whole is named when it holds at least this share of its block's parameters."""


def structure_plan(model: nn.Module, planned: Mapping[str, object], skip: tuple[str, ...] = (),
                   attention: bool = True, hidden: int | None = None) -> dict[str, str]:
    """Styles for the linear layers of each block that ``planned`` leaves out, by the rules above; ``skip``:
    modules whose layers are split otherwise (experts); ``attention``: False to plan feed-forward layers only (a
    declared plan that leaves an attention out may know of per-head state the structure does not show); ``hidden``:
    the residual width when the model's config says it (else the input width of the block's first linear layer)."""
    plan: dict[str, str] = {}
    for block_name, block in find_blocks(model):
        linears = [(f"{block_name}.{name}", module) for name, module in block.named_modules()
                   if is_linear(module) and not _covered(f"{block_name}.{name}", planned, skip)]
        if not linears:
            continue
        width = hidden or widths(linears[0][1])[0]
        heads = _head_modules(block_name, block, {name for name, _ in linears})
        split_heads = _attention(linears, heads, width) if attention else {}
        plan.update(split_heads)
        in_heads = {name for name, _ in linears for head in heads if name.startswith(head + ".")}
        rest = [(name, module) for name, module in linears if name not in split_heads and name not in in_heads]
        plan.update(_feed_forward(model, rest, width))
    return plan


def _covered(name: str, planned: Mapping[str, object], skip: tuple[str, ...]) -> bool:
    return any(name == other or name.startswith(other + ".") for other in (*planned, *skip))


def _head_modules(block_name: str, block: nn.Module, linears: set[str]) -> dict[str, int]:
    """Modules of the block with a head count that hold some of its unplanned linear layers -> their head count."""
    found = {}
    for name, module in block.named_modules():
        full = f"{block_name}.{name}" if name else block_name
        count = next((value for attr in HEAD_ATTRS if isinstance(value := getattr(module, attr, None), int)
                      and not isinstance(value, bool)), None)
        if count and name and any(linear.startswith(full + ".") for linear in linears):
            found[full] = count
    return found


def _attention(linears: list[tuple[str, nn.Module]], heads: Mapping[str, int], hidden: int) -> dict[str, str]:
    plan: dict[str, str] = {}
    order = [name for name, _ in linears]
    for head, count in heads.items():
        inside = [(name, module) for name, module in linears if name.startswith(head + ".")]
        after = linears[order.index(inside[-1][0]) + 1:]
        following = after[0] if after else None
        queries = inside
        out_layer = None
        first_out = widths(inside[0][1])[1]
        if following is not None and widths(following[1]) == (first_out, hidden):
            out_layer = following  # BERT: the heads come back in the next module
        elif len(inside) >= 2 and widths(inside[-1][1])[1] == hidden:
            queries, out_layer = inside[:-1], inside[-1]  # Llama, Bloom: in the same module
        if out_layer is None or widths(out_layer[1])[0] % count:
            continue
        styles = _query_styles(queries, widths(out_layer[1])[0], count, hidden)
        if styles is not None:
            plan.update(styles)
            plan[out_layer[0]] = "rowwise"
    return plan


def _query_styles(queries: list[tuple[str, nn.Module]], width: int, count: int, hidden: int) -> dict[str, str] | None:
    """colwise for each layer from ``H`` to whole heads (the query width, or whole key/value heads); None when one
    is something else (a fused layer of unknown order, a per-head gate)."""
    head_dim = width // count
    styles = {}
    for name, module in queries:
        given, out = widths(module)
        fused = out == 3 * width and name.rsplit(".", 1)[-1] in FUSED_HEAD_MAJOR
        if given != hidden or not (fused or (out % head_dim == 0 and out <= width)):
            return None
        styles[name] = "colwise"
    return styles


def _feed_forward(model: nn.Module, linears: list[tuple[str, nn.Module]], hidden: int) -> dict[str, str]:
    plan: dict[str, str] = {}
    run: list[str] = []
    inner = 0
    for name, module in linears:
        given, out = widths(module)
        if given == hidden and out > hidden and (not run or out == inner):
            run, inner = [*run, name], out
        elif run and (given, out) == (inner, hidden) and not _norm_of(model, [*run, name], inner):
            plan.update(dict.fromkeys(run, "colwise"))
            plan[name] = "rowwise"
            run = []
        else:
            run = [name] if given == hidden and out > hidden else []
            inner = out
    return plan


def _norm_of(model: nn.Module, names: list[str], inner: int) -> bool:
    """Whether a module beside these layers (in their parents) has a vector of the intermediate width."""
    for parent in {parent_name(name) for name in names}:
        for module in model.get_submodule(parent).children():
            if not any(is_linear(sub) for sub in module.modules()) and any(
                    param.ndim == 1 and param.shape[0] == inner for param in module.parameters()):
                return True
    return False


def left_whole(model: nn.Module, planned: Mapping[str, object], skip: tuple[str, ...] = ()) -> list[str]:
    """Weight matrices of the first block that no plan entry splits and that hold at least `LARGE` of its
    parameters (experts, in ``skip``, are split by the layout itself)."""
    blocks = find_blocks(model)
    if not blocks:
        return []
    block_name, block = blocks[0]
    total = sum(param.numel() for param in block.parameters())
    found = []
    for name, param in block.named_parameters():
        owner = parent_name(f"{block_name}.{name}")
        if param.ndim >= 2 and param.numel() >= LARGE * total and not _covered(owner, planned, skip):
            found.append(f"{block_name}.{name}")
    return found
