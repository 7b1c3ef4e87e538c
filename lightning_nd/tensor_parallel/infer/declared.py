"""Plans a model declares in the Hugging Face convention (``_tp_plan``, ``config.base_model_tp_plan``, their
expert-parallel twins), and module-name patterns (``*`` matches one name component) expanded to the model's
concrete module names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TypeVar

from torch import nn

Style = TypeVar("Style")


def pattern_to_regex(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + r"[^.]+".join(re.escape(part) for part in pattern.split("*")) + "$")


def expand(model: nn.Module, plan: Mapping[str, Style], *, declared: bool = False) -> dict[str, Style]:
    """Concrete module (or, where no module matches, parameter) names for each pattern; a pattern that matches
    nothing is an error, except in a plan the model declares: one plan serves every size of a family (dense
    layers of an MoE model, attention of a hybrid), and Hugging Face skips the entries that match nothing."""
    modules = [name for name, _ in model.named_modules() if name]
    params = [name for name, _ in model.named_parameters()]
    resolved: dict[str, Style] = {}
    for pattern, style in plan.items():
        regex = pattern_to_regex(pattern)
        matched = [name for name in modules if regex.match(name)] or [name for name in params if regex.match(name)]
        if not matched and not declared:
            raise ValueError(
                f"TP plan entry {pattern!r} matches no module of `{type(model).__name__}`."
                f" HINT: patterns are module names with `*` for one component, e.g. {_example_names(model)}."
            )
        resolved.update(dict.fromkeys(matched, style))
    return resolved


def declared_plan(model: nn.Module, attribute: str = "base_model_tp_plan") -> dict[str, str]:
    """The plan a model declares in the Hugging Face convention, keyed by full module name pattern
    (``attribute="base_model_ep_plan"``: its expert-parallel plan)."""
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        own = getattr(module, "_tp_plan" if attribute == "base_model_tp_plan" else "_ep_plan", None)
        config_plan = getattr(getattr(module, "config", None), attribute, None)
        if config_plan and getattr(type(module), "base_model_prefix", None) is not None and _is_base(module):
            plan.update({prefix + key: style for key, style in config_plan.items()})
        if isinstance(own, Mapping):
            plan.update({prefix + key: style for key, style in own.items()})
    return plan


def _is_base(module: nn.Module) -> bool:
    """An HF base model: no child is itself the base model (``model.model`` in ``LlamaForCausalLM``)."""
    prefix = getattr(type(module), "base_model_prefix", "")
    return not (prefix and isinstance(getattr(module, prefix, None), nn.Module))


def _example_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)][:3]
