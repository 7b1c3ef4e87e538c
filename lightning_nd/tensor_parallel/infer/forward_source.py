"""What a module's own ``forward`` source shows that its parameters do not: a head split it would break, and the order
of a fused projection's parts (`splits_in_three`).

TrOCR's attention (a module split by heads: the caller asks only of those) reads its width from its input
(``bsz, tgt_len, embed_dim = hidden_states.size()``) and reshapes its heads' output with it
(``attn_output.reshape(bsz, tgt_len, embed_dim)``): split by heads over tp, the output has ``embed_dim / tp``
features and the reshape fails. The source is read with `ast`; a module whose source cannot
be read (built-in, compiled) shows nothing.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterable

from torch import nn


def reshapes_with_input_width(module: nn.Module) -> str | None:
    """The source line of ``module``'s forward that unpacks its first argument's size into a width it later reshapes
    or views another tensor with; None when there is none or the source cannot be read."""
    cls = type(module)
    if cls not in _SEEN:
        _SEEN[cls] = _width_reshape(cls)
    return _SEEN[cls]


_SEEN: dict[type, str | None] = {}
"""Each module class's answer: its source is parsed once."""


def _width_reshape(cls: type) -> str | None:
    try:
        source = textwrap.dedent(inspect.getsource(getattr(cls, "forward")))
    except (OSError, TypeError):
        return None
    function = ast.parse(source).body[0]
    if not isinstance(function, ast.FunctionDef) or len(function.args.args) < 2:
        return None
    first = function.args.args[1].arg
    widths = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and _size_of(node.value, first) and isinstance(node.targets[0], ast.Tuple):
            names = node.targets[0].elts
            if len(names) >= 2 and isinstance(names[-1], ast.Name) and names[-1].id != "_":
                widths[names[-1].id] = ast.get_source_segment(source, node)
    for node in ast.walk(function):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("reshape", "view")
                and not (isinstance(node.func.value, ast.Name) and node.func.value.id == first)  # its input: whole
                and (used := [arg.id for arg in node.args if isinstance(arg, ast.Name) and arg.id in widths])):
            return widths[used[0]]
    return None


def splits_in_three(module: nn.Module, layer: str) -> bool:
    """Whether ``module``'s forward splits the output of its child ``layer`` into three names, part by part:
    ``q, k, v = self.qkv(x).split(...)``, or the output assigned to a name first (LitGPT's ``qkv = self.qkv(x)``,
    then ``q, k, v = qkv.split((q_size, k_size, v_size), dim=-1)``). False when the source cannot be read."""
    key = (type(module), layer)
    if key not in _SPLITS:
        _SPLITS[key] = _splits_in_three(type(module), layer)
    return _SPLITS[key]


_SPLITS: dict[tuple[type, str], bool] = {}


def _splits_in_three(cls: type, layer: str) -> bool:
    try:
        function = ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, "forward")))).body[0]
    except (OSError, TypeError):
        return False
    assigned = [(target.id, node.value) for node in ast.walk(function) if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)]
    # A name bound to the layer's output and never rebound: ``qkv = qkv.view(..., groups, q_per_kv + 2, ...)`` first
    # (LitGPT 0.4's layout, grouped by key/value head) is not ``[q; k; v]``.
    outputs = {name for name, value in assigned if _calls(value, layer)}
    outputs = {name for name in outputs if sum(bound == name for bound, _ in assigned) == 1}
    for node in ast.walk(function):
        if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
                and len(node.targets[0].elts) == 3 and isinstance(node.value, ast.Call)):
            continue
        split = node.value.func
        if isinstance(split, ast.Attribute) and split.attr == "split" and _on_last_dim(node.value) and (
                _calls(split.value, layer) or isinstance(split.value, ast.Name) and split.value.id in outputs):
            return True
    return False


def _on_last_dim(call: ast.Call) -> bool:
    """``.split(sizes, dim=-1)`` (or ``-1`` as the second argument): the fused output's features, not another dim."""
    dims = [keyword.value for keyword in call.keywords if keyword.arg == "dim"] + call.args[1:2]
    return len(dims) == 1 and isinstance(dims[0], ast.UnaryOp) and isinstance(dims[0].op, ast.USub) and isinstance(
        dims[0].operand, ast.Constant) and dims[0].operand.value == 1


def _calls(value: ast.expr, layer: str) -> bool:
    """``self.<layer>(...)``."""
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == layer
            and isinstance(value.func.value, ast.Name) and value.func.value.id == "self")


def _size_of(value: ast.expr, name: str) -> bool:
    """``name.size()`` or ``name.shape``."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "size":
        target = value.func.value
    elif isinstance(value, ast.Attribute) and value.attr == "shape":
        target = value.value
    else:
        return False
    return isinstance(target, ast.Name) and target.id == name


def replaced_in_forward(model: nn.Module, entries: Iterable[str]) -> str | None:
    """A module holding planned layers that swaps its attention child for a new one in its forward: BigBird's
    ``set_attention_type`` (block-sparse -> full attention for sequences shorter than its blocks) builds an unsplit
    module around the split projections. The name of the innermost such module, while the model is in the mode
    that swaps (``attention_type == "block_sparse"``)."""
    planned = list(entries)
    swapping = [name for name, module in model.named_modules() if hasattr(module, "set_attention_type")
                and getattr(module, "attention_type", None) == "block_sparse"
                and name and any(entry.startswith(name + ".") for entry in planned)]
    return swapping[-1] if swapping else None  # the innermost: the attention module itself
