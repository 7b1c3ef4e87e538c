"""Finding a model's MoE routers and counting, on the device, what each chose in every training forward.

A router is the innermost module that knows its experts' count and its top-k: an int attribute of `TOP_K_ATTRS`
(or of its ``config``, when the config counts the same experts: LitGPT's), and a weight or a direct ``nn.Linear``
child with one row per expert (or one of `EXPERT_ATTRS`). That covers the reference `lightning_nd.nn.moe.TopKRouter`
and the router modules of transformers 5 (``MixtralTopKRouter``, ``Qwen3MoeTopKRouter``, ``DeepseekV2TopkRouter``,
``GptOssTopKRouter``, ...), the MoE blocks of older releases and remote code, whose ``gate`` is a plain linear layer
and whose forward takes the top-k itself, and LitGPT's ``LLaMAMoE`` and ``GroupedTopkRouter``.

What a router chose is read from its output:
1. an integer tensor ``[..., top_k]``: the chosen experts (transformers 5 routers return them third);
2. else the top-k of the logits its ``nn.Linear`` child with E outputs made in this forward (JetMoE's gating, an
   older block's gate);
3. else the top-k of a float tensor ``[..., E]`` it returns (Llama 4's router: scores, zero but for the chosen).
Reading the top-k of logits is right only when the block selects the plain top-k of them (or of their softmax,
which keeps the order): a router with a correction bias or grouped selection (`SELECTION_ATTRS`) that returns no
indices is not counted, and says so.

Counting: a ``scatter_add`` into an int64 vector per router on the router's device (no host synchronisation but
one, at a router's first counted forward, which checks its choices lie among its experts; a router whose choice
cannot be read is left out with the reason, never stopping the run),
for forwards in training mode only, and never for the recomputation of a checkpointed block (a forward run inside
backward), the pipeline's trial forward (`lightning_nd.runtime.trial`) or a forward on meta or fake tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_nd.runtime.trial import in_trial_forward

TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "moe_topk", "router_topk", "moe_k")
EXPERT_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "n_experts")
CONFIG_TOP_K_ATTRS = (*TOP_K_ATTRS, "n_expert_per_token")
CONFIG_EXPERT_ATTRS = (*EXPERT_ATTRS, "n_expert")
"""A ``config``'s top-k and expert count (LitGPT's ``Config``: ``n_expert_per_token``, ``n_expert``)."""
SELECTION_ATTRS = ("e_score_correction_bias", "expert_bias", "n_group", "topk_group")
"""Routers whose choice is not the plain top-k of their logits (unless they return their indices)."""
WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod")


def _int_attr(holder: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(holder, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _expert_linear(module: nn.Module, experts: int | None) -> nn.Linear | None:
    """The direct ``nn.Linear`` child with one output per expert (with ``experts`` unknown: the only Linear child)."""
    linears = [child for child in module.children() if isinstance(child, nn.Linear)]
    if experts is None:
        return linears[0] if len(linears) == 1 else None
    return next((child for child in linears if child.out_features == experts), None)


def _scored(module: nn.Module) -> int | None:
    """What the module scores: its own weight's rows, else its expert-scoring linear child's outputs (LongCat's
    router scores its zero-computation experts too, which its ``num_experts`` leaves out)."""
    weight = module.__dict__.get("_parameters", {}).get("weight")
    if isinstance(weight, torch.Tensor) and weight.ndim == 2:
        return int(weight.shape[0])
    linear = _expert_linear(module, None)
    return linear.out_features if linear is not None else None


def _candidate(module: nn.Module) -> tuple[int, int] | None:
    if any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__):
        return None  # a transformers model keeps its config's expert counts (for its loss), routing nothing itself
    scored = _scored(module)
    top_k, experts = _int_attr(module, TOP_K_ATTRS), scored or _int_attr(module, EXPERT_ATTRS)
    if top_k is None and scored is not None and _int_attr(getattr(module, "config", None), CONFIG_EXPERT_ATTRS) == scored:
        top_k = _int_attr(module.config, CONFIG_TOP_K_ATTRS)  # a module scoring its config's experts (LitGPT's)
    if top_k is None or experts is None or not 1 <= top_k < experts:
        return None
    return experts, top_k


def whole_name(name: str, stage_attribute: str | None) -> str:
    """A module's name in the whole model: without activation checkpointing's and compile's wrappers, and under pp
    without the stage's own prefix (``model.stages.0.module.layers.3`` -> ``model.layers.3``)."""
    parts = [part for part in name.split(".") if part not in WRAPPERS]
    if stage_attribute is not None:
        prefix = stage_attribute.split(".")
        at = len(prefix)
        if parts[:at] == prefix and parts[at:at + 1] == ["stages"] and parts[at + 2:at + 3] == ["module"]:
            parts = prefix + parts[at + 3:]
    return ".".join(parts)


@dataclass
class Router:
    """One router, its counts since the last `take`, and how its choice is read."""

    name: str
    module: nn.Module
    experts: int
    top_k: int
    block: nn.Module | None = None
    """The reference `MoE` holding it: its experts report the assignments a capacity limit dropped."""
    counts: torch.Tensor | None = None
    tokens: int = 0
    dropped: int = 0
    unreadable: str | None = None
    """Why its choices could not be read (set at its first forward), or None."""
    _pending: torch.Tensor | None = field(default=None, repr=False)
    _checked: bool = field(default=False, repr=False)

    @property
    def reports_dropped(self) -> bool:
        return self.block is not None

    def take(self) -> tuple[list[int], int, int]:
        """The counts since the last take (one host synchronisation), and start again."""
        counts = self.counts.tolist() if self.counts is not None else [0] * self.experts
        result = (counts, self.tokens, self.dropped)
        self.counts, self.tokens, self.dropped, self._pending = None, 0, 0, None
        return result

    # ---- the hooks ---------------------------------------------------------------------------------------------

    def _counting(self, tensor: torch.Tensor) -> bool:
        return (self.module.training and torch._C._current_graph_task_id() == -1  # not a recomputation in backward
                and not in_trial_forward() and tensor.device.type != "meta"
                and not isinstance(tensor, torch._subclasses.FakeTensor))

    def on_linear(self, module: nn.Module, args: Any, output: Any) -> None:
        """The expert-scoring linear child's logits: kept in case the router's own output holds no choice."""
        if isinstance(output, torch.Tensor) and self._counting(output):
            self._pending = output

    def on_router(self, module: nn.Module, args: Any, output: Any) -> None:
        pending, self._pending = self._pending, None
        if self.unreadable is not None:
            return
        try:
            index = self._choice(output, pending)
            if index is None:
                return
            flat = index.detach().reshape(-1).to(torch.int64)
            if not self._checked and flat.numel():  # its first counted forward: checked once (one synchronisation)
                if not 0 <= int(flat.min()) <= int(flat.max()) < self.experts:
                    self.unreadable = f"it chose expert {int(flat.max())} of the {self.experts} it scores"
                    return
                self._checked = True
            if self.counts is None:
                self.counts = torch.zeros(self.experts, dtype=torch.int64, device=flat.device)
            self.counts.scatter_add_(0, flat, torch.ones_like(flat))
            self.tokens += flat.numel() // self.top_k
        except Exception as error:  # noqa: BLE001 - a diagnostic never stops the run
            self.unreadable = f"reading its choice failed: {type(error).__name__}: {error}"

    def _choice(self, output: Any, pending: torch.Tensor | None) -> torch.Tensor | None:
        """The experts this forward chose, ``[..., top_k]``; None when it is not counted (or cannot be read)."""
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        tensors = [t.to_local() if hasattr(t, "to_local") else t for t in outputs if isinstance(t, torch.Tensor)]
        if not tensors or not self._counting(tensors[0]):
            return None
        index = next((t for t in tensors if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
                      and t.ndim >= 2 and t.shape[-1] == self.top_k), None)
        if index is not None:
            return index
        logits = pending if pending is not None else next(
            (t for t in tensors if t.is_floating_point() and t.ndim >= 2 and t.shape[-1] == self.experts), None)
        if logits is None or any(getattr(self.module, a, None) is not None for a in SELECTION_ATTRS):
            self.unreadable = ("it returns no expert indices" if logits is None else
                               "it returns no expert indices and does not select the plain top-k of its logits")
            return None
        return logits.detach().topk(self.top_k, dim=-1).indices

    def on_block(self, module: nn.Module, args: Any, output: Any) -> None:
        """After the reference `MoE` block: the assignments its experts dropped in this forward."""
        if module.training and torch._C._current_graph_task_id() == -1 and not in_trial_forward():
            self.dropped += int(getattr(getattr(module, "experts", None), "last_dropped", 0))


def find_routers(model: nn.Module, stage_attribute: str | None = None) -> list[Router]:
    """Every router of ``model`` (innermost candidates: a block holding a router is not one itself), named as in the
    whole model."""
    from lightning_nd.nn.moe import MoE

    found = {name: module for name, module in model.named_modules() if _candidate(module) is not None}
    inner = [name for name in found if not any(other != name and (not name or other.startswith(f"{name}."))
                                               for other in found)]
    blocks = {id(module.gate): module for module in model.modules() if isinstance(module, MoE)}
    routers = []
    for name in inner:
        module = found[name]
        experts, top_k = _candidate(module) or (0, 0)
        routers.append(Router(whole_name(name, stage_attribute), module, experts, top_k, blocks.get(id(module))))
    return routers


def attach(routers: list[Router]) -> list[Any]:
    """Hook every router (its block and its scoring linear child where there is one); returns the handles."""
    handles = []
    for router in routers:
        linear = _expert_linear(router.module, router.experts)
        if linear is not None:
            handles.append(linear.register_forward_hook(router.on_linear))
        handles.append(router.module.register_forward_hook(router.on_router))
        if router.block is not None:
            handles.append(router.block.register_forward_hook(router.on_block))
    return handles
