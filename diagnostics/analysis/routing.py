"""Expert routing over an interval: how evenly each MoE layer's router spread its tokens, which expert collapsed or
died, which expert-parallel rank will be slow and by how much, and what practitioners change about it.

Pure: over counts of router assignments (each token routed makes ``top_k``), summed over the ranks by the counting
rule of `diagnostics.analysis.routing_counts`.

Verdicts:
- collapse: one expert takes at least ``COLLAPSE_SKEW`` of the way from its even share of the assignments (1/E) to
  the most one expert can take (1/top_k: every token);
- dead: an expert given nothing over an interval in which each expert was due at least ``DUE_FOR_DEAD``
  assignments; with fewer, the verdict is "not enough tokens" rather than a guess.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from diagnostics.records.routing import (
    CollapsedExpert,
    DeadExperts,
    LayerRouting,
    RoutingInterval,
    RoutingVerdict,
)

COLLAPSE_SKEW = 0.5
"""Fraction of the way from an even share (1/E) to all tokens (1/top_k) at which an expert's share is a collapse."""
DUE_FOR_DEAD = 10
"""Assignments each expert must have been due (total / E) before one given none is called dead."""


@dataclass(frozen=True)
class LayerLoad:
    """One router's assignments over an interval and what they say."""

    layer: str
    tokens_per_expert: tuple[int, ...]
    top_k: int
    dropped: int | None = None
    """Assignments (of `total`) a capacity limit dropped; None: the layer does not say."""

    @property
    def total(self) -> int:
        return sum(self.tokens_per_expert)

    @property
    def mean(self) -> float:
        return self.total / len(self.tokens_per_expert)

    @property
    def max_over_mean(self) -> float:
        """The busiest expert's load over the mean (1.0: even); its excess over 1 is the max violation."""
        return max(self.tokens_per_expert) / self.mean if self.total else 0.0

    @property
    def cv(self) -> float:
        """Coefficient of variation of the per-expert load (population standard deviation over the mean)."""
        if not self.total:
            return 0.0
        variance = sum((count - self.mean) ** 2 for count in self.tokens_per_expert) / len(self.tokens_per_expert)
        return math.sqrt(variance) / self.mean

    @property
    def entropy(self) -> float:
        """Entropy of the load's distribution over the experts, normalised to 1.0 for an even load."""
        experts = len(self.tokens_per_expert)
        if not self.total or experts < 2:
            return 0.0
        shares = [count / self.total for count in self.tokens_per_expert if count]
        return -sum(share * math.log(share) for share in shares) / math.log(experts)

    @property
    def dropped_fraction(self) -> float | None:
        """Assignments dropped by a capacity limit, over all the router made."""
        return None if self.dropped is None else self.dropped / self.total if self.total else 0.0

    @property
    def skew(self) -> float:
        """The busiest expert's share placed between even (0.0) and every token (1.0)."""
        experts = len(self.tokens_per_expert)
        even, most = 1 / experts, 1 / self.top_k
        if not self.total or most <= even:
            return 0.0
        return (max(self.tokens_per_expert) / self.total - even) / (most - even)

    @property
    def collapsed_expert(self) -> int | None:
        return self.tokens_per_expert.index(max(self.tokens_per_expert)) if self.skew >= COLLAPSE_SKEW else None

    @property
    def enough_for_dead(self) -> bool:
        return self.mean >= DUE_FOR_DEAD

    @property
    def dead_experts(self) -> tuple[int, ...]:
        """Experts given nothing, when each was due enough to tell (else empty: see `enough_for_dead`)."""
        return tuple(i for i, count in enumerate(self.tokens_per_expert) if not count) if self.enough_for_dead else ()


def ep_rank_load(tokens_per_expert: Sequence[int], ep: int) -> list[int]:
    """Assignments each expert-parallel rank runs: rank r holds experts ``r * E/ep .. (r+1) * E/ep - 1`` (the
    placement `lightning_nd.expert_parallel.dispatch` applies and the Layout's ``experts`` record)."""
    experts = len(tokens_per_expert)
    if ep < 1 or experts % ep:
        raise ValueError(f"ep={ep} does not divide the {experts} experts")
    local = experts // ep
    return [sum(tokens_per_expert[rank * local:(rank + 1) * local]) for rank in range(ep)]


SOURCES = ("reference", "hugging_face")
"""Where a run's MoE layers come from: `lightning_nd.nn.moe.MoE` (the knobs are Hydra keys of the example's
``conf/model/moe.yaml`` and `MoE` arguments), or a transformers family (its config's keys)."""
ADVICE = (
    ("raise the load-balancing loss weight (0.01 by default; 0.02-0.05 is common)",
     "`model.moe_aux_loss_coef` (`MoE(aux_loss_coef=...)`)",
     "the model config's `router_aux_loss_coef`, with `output_router_logits=True` (without it the loss is not"
     " added to the training loss)"),
    ("set a capacity factor: an expert takes at most that multiple of its even share, the rest is dropped (the"
     " dropped fraction is reported)",
     "`model.moe_capacity_factor=1.25` (`MoE(capacity_factor=...)`)", None),
    ("route at random for the first steps, annealed to the learned router",
     "`model.moe_random_routing_steps=100` (`MoE(random_routing_steps=...)`)", None),
    ("use the loss-free bias: after each optimizer step the router's per-expert bias moves against the load it saw",
     "`model.moe_bias_update_rate=1e-3` (`MoE(bias_update_rate=...)`)", None),
)
"""What practitioners change when routing is uneven: (what, the reference layer's key, a transformers config's key
or None where transformers has none)."""


def advice(found: RoutingVerdict, source: str = "reference") -> tuple[str, ...]:
    """The `ADVICE` when a layer collapsed or has dead experts, each naming the key that sets it for ``source`` (one
    of `SOURCES`); nothing for healthy routing."""
    if source not in SOURCES:
        raise ValueError(f"source={source!r} is not one of {SOURCES}")
    if found.healthy:
        return ()
    lines = []
    for what, reference, hugging_face in ADVICE:
        if source == "reference":
            lines.append(f"{what}: {reference}")
        else:
            lines.append(f"{what}: {hugging_face}" if hugging_face else
                         f"{what}: no transformers config key; the reference layer has it, {reference}")
    return tuple(lines)


def verdict(layers: Sequence[LayerLoad], ep: int = 1, source: str = "reference",
            ep_layers: Collection[str] | None = None) -> RoutingVerdict:
    """``ep_layers``: the layers whose experts expert parallelism splits (the Layout's ``experts`` placement; None:
    every layer when ``ep`` > 1)."""
    collapsed = tuple(CollapsedExpert(layer.layer, expert, max(layer.tokens_per_expert) / layer.total)
                      for layer in layers if (expert := layer.collapsed_expert) is not None)
    dead = tuple(DeadExperts(layer.layer, layer.dead_experts) for layer in layers if layer.dead_experts)
    too_few = tuple(layer.layer for layer in layers if layer.total and not layer.enough_for_dead)
    slowest, slowdown = None, None
    loads = [ep_rank_load(layer.tokens_per_expert, ep) for layer in layers
             if layer.total and _split(layer.layer, ep, ep_layers)]
    if loads:
        per_rank = [sum(column) for column in zip(*loads)]
        slowest = per_rank.index(max(per_rank))
        slowdown = sum(max(load) for load in loads) / (sum(sum(load) for load in loads) / ep)
    found = RoutingVerdict(collapsed, dead, too_few, slowest, slowdown)
    return RoutingVerdict(collapsed, dead, too_few, slowest, slowdown, advice(found, source))


def _split(layer: str, ep: int, ep_layers: Collection[str] | None) -> bool:
    return ep > 1 and (ep_layers is None or layer in ep_layers)


def interval(first_step: int, step: int, layers: Sequence[LayerLoad], ep: int = 1, source: str = "reference",
             counted: str = "", ep_layers: Collection[str] | None = None) -> RoutingInterval:
    """The record of one interval: every layer's counts and statistics, the load per ep rank, the verdict."""
    records = {layer.layer: LayerRouting(
        tokens_per_expert=layer.tokens_per_expert, top_k=layer.top_k, tokens=layer.total // layer.top_k,
        dropped=layer.dropped, max_over_mean=layer.max_over_mean, cv=layer.cv, entropy=layer.entropy,
        tokens_per_ep_rank=tuple(ep_rank_load(layer.tokens_per_expert, ep))
        if _split(layer.layer, ep, ep_layers) else None) for layer in layers}
    split = [r.tokens_per_ep_rank for r in records.values() if r.tokens_per_ep_rank is not None]
    per_rank = tuple(sum(column) for column in zip(*split)) if split else None
    return RoutingInterval(first_step, step, records, ep, per_rank, verdict(layers, ep, source, ep_layers), counted)


def across_layers(values: Sequence[float]) -> dict[str, float]:
    """A statistic over the layers as ``min``, ``p50``, ``p90`` and ``max`` (nearest rank)."""
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"min": ordered[0], "p50": rank(0.5), "p90": rank(0.9), "max": ordered[-1]}
