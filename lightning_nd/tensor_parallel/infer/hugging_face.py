"""The tensor-parallel styles Hugging Face ``transformers`` declares in model plans, and what each means here.

A declared plan is read with Hugging Face's meaning (``transformers/distributed/tensor_parallel.py``), which
differs from ours for one name: HF's ``colwise_gather_output`` on a layer inside a block (Phi-3's fused
``qkv_proj``) is a colwise layer whose output is gathered back to full width, not an output head with
vocabulary-sharded logits. The names come from the installed ``transformers`` (its ``ALL_PARALLEL_STYLES``
registry), so a style that a newer release adds is refused by name instead of being misread.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import nn

from lightning_nd.model.structure import get_submodule, is_experts, is_transposed_experts, parent_name
from lightning_nd.tensor_parallel.infer.declared import declared_plan, expand
from lightning_nd.tensor_parallel.infer.mla import rope_dim

log = logging.getLogger(__name__)

MEANINGS = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "packed_colwise": "packed_colwise",
    "colwise_rep": "colwise_rep",
    "rowwise_split_input": "rowwise_split_input",
    "rowwise_rep": "rowwise_split_input",
    "embedding_rowwise": "embedding_rowwise",
    "embedding_colwise": "embedding_colwise",
    "sequence_parallel": "sequence_parallel",
    "replicate": "replicate",
    "replicated_with_grad_allreduce": "replicated_with_grad_allreduce",
    "mla_kv_a_proj": "mla_kv_a_proj",
    "unit_colwise": "colwise",
    "unit_rowwise": "rowwise",
}
"""HF style -> our style of the same meaning (``colwise_gather_output`` is decided per module, see `_head_or_rep`).
HF's ``unit_colwise``/``unit_rowwise`` split by whole heads and copy heads where tp exceeds their count; here they
are colwise/rowwise, whose check refuses a tp that does not divide the head counts (naming the tps that do)."""

EXPERT_TP = "expert tensor parallelism (every rank a slice of every expert) is not implemented"
REFUSED = {
    "moe_tp_experts": EXPERT_TP,
    "moe_identity_expert": EXPERT_TP,
    "packed_rowwise": EXPERT_TP + " (it splits fused expert weights)",
    "all_reduce": EXPERT_TP + " (it sums the partial outputs of experts split by tp)",
    "ep_dispatch_experts": "it is an expert-parallel style: ep reads experts from the model, not from the tp plan",
    "grouped_gemm": "it is an expert-parallel style: ep reads experts from the model, not from the tp plan",
}
"""HF style -> why it is refused here."""

HEAD_NAMES = ("lm_head", "output", "head", "out")
EXPERT_STYLES = ("moe_tp_experts", "packed_colwise", "rowwise", "colwise", "packed_rowwise", "all_reduce")
"""Styles a declared plan splits experts with (on the experts module or its stacked parameters)."""


class TPPlanRefusal(ValueError):
    """A plan names a piece this strategy does not apply; ``pieces`` maps each refused style to one module."""

    def __init__(self, message: str, pieces: Mapping[str, str]) -> None:
        super().__init__(message)
        self.pieces = dict(pieces)


def installed_styles() -> frozenset[str]:
    """The style names the installed ``transformers`` registers (empty without transformers)."""
    try:
        import transformers.distributed.expert_parallel  # noqa: F401  (registers the ep styles)
        import transformers.distributed.tensor_parallel  # noqa: F401  (registers the tp styles)
        from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    except ImportError:
        return frozenset()
    return frozenset(ALL_PARALLEL_STYLES.keys())


def declared_experts(model: nn.Module) -> list[str]:
    """The experts modules a model names in its declared expert-parallel plan (``base_model_ep_plan``): the
    modules its ep styles are applied to (a parameter entry names its module)."""
    plan = declared_plan(model, attribute="base_model_ep_plan")
    names = {name for name, _ in model.named_modules()}
    return sorted({name if name in names else parent_name(name) for name in expand(model, plan, declared=True)})


def experts_modules(model: nn.Module) -> list[str]:
    """Experts modules: those the model declares (`declared_experts`) and those in the stacked layout."""
    return sorted(set(declared_experts(model)) | {name for name, m in model.named_modules() if name and is_experts(m)})


def hf_meaning(model: nn.Module, entries: Mapping[str, str], blocks: list[str]) -> dict[str, str]:
    """Our style for every entry of a declared plan; refuses (naming style and module) what has no meaning here.

    Entries on experts (``moe_tp_experts``, expert parameters) are left out: the plan splits stacked experts over
    tp itself (expert tensor parallelism, `lightning_nd.layout.plan._expert_tp`), or keeps them whole on every tp
    rank, where they see the same tokens (the router and the experts' input are replicated over tp); ep, which
    borrows dp_shard x cp ranks, splits them by expert. Llama 4's experts (transposed stacks that see every token,
    `is_transposed_experts`) are split over tp by their ``moe_tp_experts`` entry: ``transposed_experts``."""
    known = installed_styles() | set(MEANINGS) | {"colwise_gather_output"}
    refused: dict[str, tuple[str, str]] = {}
    resolved: dict[str, str] = {}
    params = dict(model.named_parameters())
    experts = experts_modules(model)
    skipped = [name for name, style in entries.items()
               if style in EXPERT_STYLES and any(name == e or name.startswith(e + ".") for e in experts)]
    if skipped:
        log.info("The declared expert tp entries are not applied; the layout splits the experts over tp itself, or"
                 " says why they stay whole: %s", ", ".join(experts))
    transposed = {name for name in entries if name in dict(model.named_modules())
                  and is_transposed_experts(get_submodule(model, name))}
    for name, style in entries.items():
        if name in skipped or parent_name(name) in transposed:  # the module's entry splits its stacks
            continue
        if name in transposed and style == "moe_tp_experts":
            resolved[name] = "transposed_experts"
        elif style not in known:
            refused.setdefault(style, (name, "it is not a style of the installed `transformers`"))
        elif style in REFUSED:
            refused.setdefault(style, (name, REFUSED[style]))
        elif name in params and _per_head(entries, name, style):
            resolved[parent_name(name)] = "per_head_params"
        elif style == "local_params":
            continue  # what it declares is done by `per_head_params` on the module its parameter entries name
        elif name in params:
            reason = EXPERT_TP if _in_experts(model, name) else "a plan entry that names a bare parameter is not applied"
            refused.setdefault(f"{style} on a parameter", (name, reason))
        elif style == "mla_kv_a_proj" and rope_dim(model, name) is None:
            reason = "its attention module (and its `config`) has no `qk_rope_head_dim`: the shared rotary key's width"
            refused.setdefault(style, (name, reason))
        elif style == "colwise_gather_output":
            resolved[name] = _head_or_rep(name, blocks)
        elif style in MEANINGS:
            resolved[name] = MEANINGS[style]
        else:
            refused.setdefault(style, (name, "this version of lightning_nd does not know it"))
    for owner in [name for name, style in resolved.items() if style == "per_head_params"]:
        undeclared = [f"{owner}.{param}" for param, _ in get_submodule(model, owner).named_parameters(recurse=False)
                      if entries.get(f"{owner}.{param}") != "colwise"]
        if undeclared:
            refused.setdefault("local_params", (owner, f"its own parameter `{undeclared[0]}` has no per-head entry"))
    if refused:
        raise TPPlanRefusal(_refusal_message(model, refused), {style: name for style, (name, _) in refused.items()})
    return resolved


def _per_head(entries: Mapping[str, str], param_name: str, style: str) -> bool:
    """A bare parameter declared ``colwise`` whose module is declared ``local_params`` (attention sinks, Beam's
    ``gate_bias``): split on its first dim with the module's heads, used as local shards in its forward."""
    return style == "colwise" and entries.get(parent_name(param_name)) == "local_params"


def _in_experts(model: nn.Module, param_name: str) -> bool:
    owner = parent_name(param_name)
    return "expert" in owner.lower() or get_submodule(model, owner).get_parameter(param_name.rsplit(".", 1)[-1]).ndim == 3


def _head_or_rep(name: str, blocks: list[str]) -> str:
    """The output head keeps our ``colwise_gather_output`` (loss parallel may leave it vocabulary-sharded);
    any other layer (fused projections inside blocks, a vision projector) gathers its output: ``colwise_rep``."""
    inside = any(name.startswith(block + ".") for block in blocks)
    return "colwise_gather_output" if not inside and name.rsplit(".", 1)[-1] in HEAD_NAMES else "colwise_rep"


def _refusal_message(model: nn.Module, refused: Mapping[str, tuple[str, str]]) -> str:
    lines = "".join(f"\n  `{name}` ({style}): {reason}." for style, (name, reason) in refused.items())
    return (
        f"`{type(model).__name__}` declares tensor-parallel styles that lightning_nd does not apply:{lines}\n"
        "  HINT: pass `NDParallel(tp_plan=...)` that leaves these modules out (e.g. the attention and dense MLP"
        " layers only: unplanned modules stay whole on every tp rank), or shard experts with `ep` instead of `tp`."
    )
