"""Expert routing over an interval: how evenly each MoE layer's router spread its tokens, which expert collapsed or
died, which expert-parallel rank will be slow, and what practitioners change about it.

Pure: over counts of router assignments (tokens x top_k per layer), as recorded by each rank.

Counting rule (`merge_ranks`): each rank counts what its own routers chose for its own tokens. Ranks that see
different tokens (batch and cp ranks; ep borrows them, so its ranks too) are summed; tp ranks hold copies of the
same routing and only one of each tp group is counted; pp stages hold different layers, which are gathered, never
summed. The counts are the router's choices before any expert-parallel exchange: the all-to-all's received counts
would count every assignment a second time on the rank that runs it.

Verdicts:
- collapse: one expert takes at least ``COLLAPSE_SKEW`` of the way from its even share of the assignments (1/E) to
  the most one expert can take (1/top_k, every token);
- dead: an expert given nothing over an interval in which each expert was due at least ``DUE_FOR_DEAD``
  assignments; with fewer, the verdict is "not enough tokens" rather than a guess.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

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
    dropped: int = 0

    @property
    def total(self) -> int:
        return sum(self.tokens_per_expert)

    @property
    def mean(self) -> float:
        return self.total / len(self.tokens_per_expert)

    @property
    def max_over_mean(self) -> float:
        """The busiest expert's load over the mean (1.0: even); its excess is the max violation."""
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
    def dropped_fraction(self) -> float:
        """Assignments dropped by a capacity limit, over all the router made."""
        made = self.total + self.dropped
        return self.dropped / made if made else 0.0

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


def merge_ranks(records: Mapping[int, Mapping[str, Sequence[int]]], counted: Collection[int]) -> dict[str, list[int]]:
    """Per layer, the sum of the ``counted`` ranks' counts (one rank of each tp group: tp copies route alike). A
    layer appears on the ranks of its pipeline stage only; ranks that hold it are summed, the others add nothing.
    Raises on counts of different lengths for one layer (ranks disagreeing on its experts)."""
    merged: dict[str, list[int]] = {}
    for rank in sorted(counted):
        for layer, counts in records.get(rank, {}).items():
            total = merged.setdefault(layer, [0] * len(counts))
            if len(total) != len(counts):
                raise ValueError(f"rank {rank} counts {len(counts)} experts in `{layer}`, others {len(total)}")
            merged[layer] = [a + b for a, b in zip(total, counts)]
    return merged


def ep_rank_load(tokens_per_expert: Sequence[int], ep: int) -> list[int]:
    """Assignments each expert-parallel rank runs: rank r holds experts ``r * E/ep .. (r+1) * E/ep - 1``."""
    experts = len(tokens_per_expert)
    if ep < 1 or experts % ep:
        raise ValueError(f"ep={ep} does not divide the {experts} experts")
    local = experts // ep
    return [sum(tokens_per_expert[rank * local:(rank + 1) * local]) for rank in range(ep)]


@dataclass(frozen=True)
class RoutingVerdict:
    collapsed: tuple[tuple[str, int, float], ...]
    """(layer, expert, share of the layer's assignments) for each collapsed layer."""
    dead: tuple[tuple[str, tuple[int, ...]], ...]
    too_few: tuple[str, ...]
    """Layers whose experts were each due fewer than `DUE_FOR_DEAD` assignments: no dead-expert verdict."""
    slowest_ep_rank: tuple[int, float] | None
    """(rank, its load over the mean EP rank's), summed over layers, when ep > 1."""

    @property
    def healthy(self) -> bool:
        return not self.collapsed and not self.dead


def verdict(layers: Sequence[LayerLoad], ep: int = 1) -> RoutingVerdict:
    collapsed = tuple((layer.layer, expert, max(layer.tokens_per_expert) / layer.total) for layer in layers
                      if (expert := layer.collapsed_expert) is not None)
    dead = tuple((layer.layer, layer.dead_experts) for layer in layers if layer.dead_experts)
    too_few = tuple(layer.layer for layer in layers if layer.total and not layer.enough_for_dead)
    slowest = None
    if ep > 1 and layers:
        per_rank = [sum(loads) for loads in zip(*(ep_rank_load(layer.tokens_per_expert, ep) for layer in layers))]
        mean = sum(per_rank) / ep
        if mean:
            rank = per_rank.index(max(per_rank))
            slowest = (rank, per_rank[rank] / mean)
    return RoutingVerdict(collapsed, dead, too_few, slowest)


ADVICE = (
    "raise the load-balancing loss weight (`MoE(aux_loss_coef=...)`, 0.01 by default; 0.02-0.05 is common)",
    "set a capacity factor (`MoE(capacity_factor=1.25)`): an expert takes at most that multiple of its even share,"
    " the rest is dropped (the dropped fraction is reported)",
    "route at random for the first steps (`MoE(random_routing_steps=...)`), annealed to the learned router",
    "use the loss-free bias (`MoE(bias_update_rate=1e-3)`): each step nudges the router's per-expert bias against"
    " the load it saw",
)
"""What practitioners change when routing is uneven, each with the argument that sets it."""


def advice(found: RoutingVerdict) -> tuple[str, ...]:
    """The `ADVICE` when a layer collapsed or has dead experts; nothing for healthy routing."""
    return () if found.healthy else ADVICE
