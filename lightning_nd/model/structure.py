"""What a model looks like to the parallelizer: its repeated blocks, attention modules, head counts and experts.

Pure inspection of an ``nn.Module``; nothing here changes the model or talks to other ranks.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn

HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "n_local_heads")
KV_HEAD_ATTRS = ("num_kv_heads", "n_kv_heads", "num_key_value_heads", "n_local_kv_heads")
CONFIG_FACTS = {
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads"),
    "num_key_value_heads": ("num_key_value_heads", "n_kv_heads"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "n_layers"),
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
}


def find_blocks(model: nn.Module, block_classes: Sequence[type | str] | None = None) -> list[tuple[str, nn.Module]]:
    """The repeated blocks (transformer layers) of ``model``, outermost matches only, in order.

    With ``block_classes`` (classes or class names), every outermost module of those classes.
    Otherwise the children of the container (``ModuleList``/``Sequential``/``ModuleDict``) holding the
    most parameters in two or more children of one class.
    """
    if block_classes:
        wanted = tuple(c for c in block_classes if isinstance(c, type))
        names = {c for c in block_classes if isinstance(c, str)}
        matches = [
            (name, module)
            for name, module in model.named_modules()
            if name and (isinstance(module, wanted) or type(module).__name__ in names)
        ]
        return _outermost(matches)
    best: list[tuple[str, nn.Module]] = []
    best_params = 0
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue
        children = [(f"{name}.{child_name}" if name else child_name, child) for child_name, child in module.named_children()]
        by_class: dict[type, list[tuple[str, nn.Module]]] = {}
        for child_name, child in children:
            by_class.setdefault(type(child), []).append((child_name, child))
        for group in by_class.values():
            params = sum(p.numel() for _, child in group for p in child.parameters())
            if len(group) >= 2 and params > best_params:
                best, best_params = group, params
    return best


def _outermost(matches: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    kept: list[tuple[str, nn.Module]] = []
    for name, module in matches:
        if not any(name.startswith(parent + ".") for parent, _ in kept):
            kept.append((name, module))
    return kept


def is_norm(module: nn.Module) -> bool:
    """LayerNorm, RMSNorm and the many model-specific norms named ``*Norm``."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.lower().endswith("norm")


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's ``transformers.pytorch_utils.Conv1D``: a linear layer whose weight is stored ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def widths(module: nn.Module) -> tuple[int, int]:
    """(input, output) features of a linear layer (``Conv1D`` stores its weight ``[in, out]``)."""
    weight = module.weight
    assert isinstance(weight, Tensor), f"{type(module).__name__} has no weight matrix"
    return (weight.shape[0], weight.shape[1]) if is_conv1d(module) else (weight.shape[1], weight.shape[0])


def linear_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if is_linear(module)]


def parent_name(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def get_submodule(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name) if name else model


def owns_parameters(module: nn.Module, recurse: bool = True) -> bool:
    return any(True for _ in module.parameters(recurse=recurse))


def model_child(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The one child that holds every parameter (``self.model`` of a LightningModule) with its attribute name;
    None when ``module`` owns parameters itself or they sit in several children."""
    owners = [(name, child) for name, child in module.named_children() if owns_parameters(child)]
    if owns_parameters(module, recurse=False) or len(owners) != 1:
        return None
    return owners[0]


def model_of(module: nn.Module) -> nn.Module:
    """The model a LightningModule holds (`model_child`), else ``module`` itself."""
    child = model_child(module)
    return child[1] if child is not None else module


@dataclass
class ModelFacts:
    """Sizes the parallel dims must divide, read from an HF-style ``config`` or from module attributes."""

    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_experts: int | None = None
    sources: dict[str, str] = field(default_factory=dict)


def read_model_facts(model: nn.Module, blocks: Iterable[tuple[str, nn.Module]] | None = None) -> ModelFacts:
    """Collect the sizes parallel dims must divide; the first place that names a fact wins."""
    facts = ModelFacts()
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None or isinstance(config, (dict, str)):
            continue
        for fact, attrs in CONFIG_FACTS.items():
            _set_fact(facts, fact, (getattr(config, attr, None) for attr in attrs), f"`{name or 'model'}.config`")
    for name, module in model.named_modules():
        _set_fact(facts, "num_attention_heads", (getattr(module, a, None) for a in HEAD_ATTRS), f"`{name}`")
        _set_fact(facts, "num_key_value_heads", (getattr(module, a, None) for a in KV_HEAD_ATTRS), f"`{name}`")
    block_list = list(blocks) if blocks is not None else find_blocks(model)
    if block_list:
        _set_fact(facts, "num_hidden_layers", [len(block_list)], "the repeated blocks")
    return facts


def _set_fact(facts: ModelFacts, fact: str, candidates: Iterable[object], source: str) -> None:
    if getattr(facts, fact) is not None:
        return
    for value in candidates:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            setattr(facts, fact, value)
            facts.sources[fact] = source
            return


def is_experts(module: nn.Module) -> bool:
    """Stacked SwiGLU experts in the Hugging Face layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    gate_up, down = (getattr(module, name, None) for name in ("gate_up_proj", "down_proj"))
    if not (isinstance(gate_up, Tensor) and isinstance(down, Tensor) and gate_up.ndim == down.ndim == 3):
        return False
    experts, double_inner, hidden = gate_up.shape
    return down.shape == (experts, hidden, double_inner // 2) and double_inner % 2 == 0


def is_transposed_experts(module: nn.Module) -> bool:
    """Llama 4's experts: stacks stored as the layers' inputs by outputs, gate_up_proj [E, H, 2I] and down_proj
    [E, I, H], run on every token (pre-scaled by its router score) with ``bmm``: nothing to dispatch."""
    gate_up, down = (getattr(module, name, None) for name in ("gate_up_proj", "down_proj"))
    if not (isinstance(gate_up, Tensor) and isinstance(down, Tensor) and gate_up.ndim == down.ndim == 3):
        return False
    experts, hidden, double_inner = gate_up.shape
    return down.shape == (experts, double_inner // 2, hidden) and double_inner % 2 == 0 and hidden != double_inner // 2


DEFAULT_GATING = ("_default_apply_gate",)
"""transformers' own ``act_fn(gate) * up``, which its experts classes take as ``_apply_gate``."""
OWN_GATING = ("limit", "alpha", "swiglu_limit", "swiglu_alpha")
"""Attributes of experts that compute more than ``act(gate) * up`` (GPT-OSS's clamped, scaled SwiGLU)."""


def unsupported_experts(module: nn.Module) -> list[str]:
    """What of an experts module expert parallelism (by expert or over tp) would not carry over: parameters beyond
    the two stacks (biases), and code of its own (a method beside ``forward``, as MiniMax-M3's clamped ``_apply_gate``, or a
    gating attribute of `OWN_GATING`), since the split module computes ``down(act(gate) * up)`` itself."""
    extra = [name for name, _ in module.named_parameters() if name not in ("gate_up_proj", "down_proj")]
    methods = [name for cls in type(module).__mro__ if cls not in nn.Module.__mro__
               for name, value in vars(cls).items()
               if callable(value) and name not in ("__init__", "forward", "extra_repr", "reset_parameters")
               and getattr(value, "__name__", "") not in DEFAULT_GATING]
    return extra + [f"`{name}`" for name in methods] + [name for name in OWN_GATING if hasattr(module, name)]


def torch_class(module: str, name: str) -> type | None:
    """``module.name`` if ``module`` is loaded, else None. Planning never imports DTensor or FSDP for a check (about
    1 s): an object of such a class (a style, a sharded parameter) exists only once its module is loaded, so a class
    not loaded answers no."""
    return getattr(sys.modules.get(module), name, None)
