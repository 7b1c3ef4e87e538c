"""How the ranks' router counts become one interval's counts: the counting rule and the one reduction.

Pure: the monitor (`diagnostics.collect.routers`) packs each rank's counts into one vector of integers laid out by
`Slots`, the ranks' vectors are summed (one collective), and `Slots.unpack` reads the sum back.

The counting rule: each rank counts what its own routers chose for its own tokens.

- Ranks that see different tokens are summed: the batch ranks (dp_replicate x dp_shard) and cp ranks; expert
  parallelism borrows its ranks from those, so ep ranks are summed too. The counts are each router's choices before
  the expert-parallel exchange: the counts a rank receives from the all-to-all (and the ep group's totals the
  reference layer keeps for its loss) are never added, or every assignment would count twice.
- tp ranks hold copies of the same routing, counted once (`counts_on_this_tp_rank`): only tp rank 0 adds its
  counts. With sequence parallelism a router may see only its tp rank's share of the sequence; then every tp rank
  adds its own.
- Pipeline stages hold different layers: each layer has its own slot, which only the ranks holding the layer fill,
  so the sum gathers the stages' layers side by side and never adds one stage's layer to another's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Slot:
    """One router's place in the vector: ``experts`` counts, then tokens routed, then dropped assignments."""

    layer: str
    experts: int
    top_k: int
    reports_dropped: bool

    @property
    def width(self) -> int:
        return self.experts + 2


@dataclass(frozen=True)
class Slots:
    slots: tuple[Slot, ...]

    @classmethod
    def of(cls, per_rank: Iterable[Iterable[Slot]]) -> Slots:
        """Every rank's routers, in name order: the same table on every rank. Raises when two ranks disagree on a
        router (its experts, top-k or whether it reports drops)."""
        table: dict[str, Slot] = {}
        for rank, slots in enumerate(per_rank):
            for slot in slots:
                known = table.setdefault(slot.layer, slot)
                if known != slot:
                    raise ValueError(f"rank {rank} sees router `{slot.layer}` as {slot}, another rank as {known}")
        return cls(tuple(table[name] for name in sorted(table)))

    @property
    def size(self) -> int:
        return sum(slot.width for slot in self.slots)

    @cached_property
    def offsets(self) -> dict[str, int]:
        """Where each router's counts start in the vector."""
        starts, start = {}, 0
        for slot in self.slots:
            starts[slot.layer], start = start, start + slot.width
        return starts

    def pack(self, mine: dict[str, tuple[Sequence[int], int, int]]) -> list[int]:
        """This rank's ``layer -> (tokens per expert, tokens, dropped)`` as its vector (zeros where it holds no such
        layer, or does not count it). The monitor builds the same vector on the device; this is its plain form."""
        vector = [0] * self.size
        for layer, (counts, tokens, dropped) in mine.items():
            start = self.offsets[layer]
            vector[start:start + self.slots_by_name[layer].width] = [*counts, tokens, dropped]
        return vector

    @cached_property
    def slots_by_name(self) -> dict[str, Slot]:
        return {slot.layer: slot for slot in self.slots}

    def unpack(self, summed: Sequence[int]) -> dict[str, tuple[list[int], int, int | None]]:
        """The summed vector as ``layer -> (tokens per expert, tokens routed, dropped or None)``."""
        if len(summed) != self.size:
            raise ValueError(f"{len(summed)} values for {self.size} slots")
        result: dict[str, tuple[list[int], int, int | None]] = {}
        start = 0
        for slot in self.slots:
            counts = [int(c) for c in summed[start:start + slot.experts]]
            tokens, dropped = int(summed[start + slot.experts]), int(summed[start + slot.experts + 1])
            result[slot.layer] = (counts, tokens, dropped if slot.reports_dropped else None)
            start += slot.width
        return result


def counts_on_this_tp_rank(tp_rank: int, tp: int, sequence_parallel: bool, routed_tokens: int,
                           batch_tokens: int | None) -> bool:
    """Whether this rank adds a router's counts to the sum (see the module's counting rule).

    Without sequence parallelism every tp rank routes the same tokens: tp rank 0 counts. With it, a router that
    routed as many tokens as this rank's batch holds saw the whole sequence (a copy: tp rank 0 counts); one that
    routed fewer saw its share (every tp rank counts); when the batch's size is unknown, the share is assumed."""
    if tp == 1 or tp_rank == 0:
        return True
    if not sequence_parallel:
        return False
    return batch_tokens is None or routed_tokens != batch_tokens


def dropped_on_this_ep_rank(ep_rank: int | None) -> bool:
    """An expert-parallel layer's dropped count is the ep group's (its capacity is the group's): rank 0 of the group
    adds it; a layer without ep (``ep_rank`` None) counts its own."""
    return ep_rank in (None, 0)
