"""What the `RoutingMonitor` records: one `RoutingInterval` per logging interval, a line of
``<log_dir>/diagnostics/routing.jsonl`` (`diagnostics.records.files.ROUTING_FILE`), written by rank 0.

Counts are router assignments (each token routed makes ``top_k`` of them) summed over every forward of the interval
(each microbatch and accumulation step, never a checkpointed block's recomputation) and over the ranks that see
different tokens; a layer's name is its router's module name in the whole model (the same under every layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LayerRouting:
    """One router over an interval."""

    tokens_per_expert: tuple[int, ...]
    """Assignments each expert was given by the router (before any capacity limit dropped some)."""
    top_k: int
    tokens: int
    """Tokens routed: ``sum(tokens_per_expert) == tokens * top_k``."""
    dropped: int | None
    """Assignments a capacity limit dropped; None when the layer does not report them (dropless families)."""
    max_over_mean: float
    cv: float
    entropy: float
    """Of the load's distribution over the experts, normalised: 1.0 is even, 0.0 all on one expert."""
    tokens_per_ep_rank: tuple[int, ...] | None = None
    """Assignments each expert-parallel rank runs for this layer (None without ep)."""


@dataclass(frozen=True)
class CollapsedExpert:
    layer: str
    expert: int
    share: float
    """Of the layer's assignments."""


@dataclass(frozen=True)
class DeadExperts:
    layer: str
    experts: tuple[int, ...]


@dataclass(frozen=True)
class RoutingVerdict:
    collapsed: tuple[CollapsedExpert, ...] = ()
    dead: tuple[DeadExperts, ...] = ()
    too_few: tuple[str, ...] = ()
    """Layers whose experts were each due too few assignments to call one dead."""
    slowest_ep_rank: int | None = None
    """The expert-parallel rank with the most assignments over the interval's layers (None without ep)."""
    ep_slowdown: float | None = None
    """Expert compute time under ep over a perfectly balanced one: each layer waits for its busiest ep rank, so
    ``sum over layers of max load / sum over layers of mean load`` (1.0: balanced)."""
    advice: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        return not self.collapsed and not self.dead


@dataclass(frozen=True)
class RoutingInterval:
    first_step: int
    step: int
    """The interval's optimizer steps: ``first_step`` to ``step``, both included."""
    layers: dict[str, LayerRouting]
    ep: int = 1
    tokens_per_ep_rank: tuple[int, ...] | None = None
    """Every layer's `LayerRouting.tokens_per_ep_rank` summed."""
    verdict: RoutingVerdict = field(default_factory=RoutingVerdict)
    counted: str = ""
    """How the ranks' counts were combined, in words."""

