"""Which parts of one ring block a rank computes under a causal mask, from the tokens' true positions.

A rank's shard is one or more runs of consecutive positions (head-tail sharding: two sub-chunks, an early one and
a late one). For each pair of a query run and a key run: every query after every key attends fully (the non-causal
kernel); every query before every key sees nothing, so the pair is skipped; the same run on both sides is the
diagonal (the causal kernel). Anything else (runs that overlap without coinciding, only from irregular positions)
is computed with an explicit mask. Full pairs that sit next to each other are computed as one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Pair:
    """Queries at indices ``q`` against keys at indices ``k`` of the block: ``full``, ``causal`` (the diagonal of
    a square pair) or ``masked`` (``mask`` [Sq, Sk], True where a query sees a key)."""

    q: slice
    k: slice
    kind: str
    mask: torch.Tensor | None = None

    @property
    def work(self) -> int:
        """Query-key pairs the kernel scores (the causal kernel skips the upper triangle)."""
        rows, cols = self.q.stop - self.q.start, self.k.stop - self.k.start
        return rows * (rows + 1) // 2 if self.kind == "causal" else rows * cols


def runs(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive positions: (first index, length, first position)."""
    starts = [0, *((torch.nonzero(positions[1:] - positions[:-1] != 1).flatten() + 1).tolist())]
    ends = [*starts[1:], positions.numel()]
    values = positions.tolist()
    return [(start, end - start, values[start]) for start, end in zip(starts, ends)]


def block_pairs(q_positions: torch.Tensor, k_positions: torch.Tensor, causal: bool) -> list[Pair]:
    """The calls that compute this rank's queries (at ``q_positions``) against one block of keys; none when
    every key is after every query."""
    if not causal:
        return [Pair(slice(0, q_positions.numel()), slice(0, k_positions.numel()), "full")]
    pairs = []
    for q_start, q_len, q_first in runs(q_positions):
        for k_start, k_len, k_first in runs(k_positions):
            rows, cols = slice(q_start, q_start + q_len), slice(k_start, k_start + k_len)
            if q_first >= k_first + k_len - 1:
                pairs.append(Pair(rows, cols, "full"))
            elif q_first + q_len - 1 < k_first:
                continue
            elif q_first == k_first and q_len == k_len:
                pairs.append(Pair(rows, cols, "causal"))
            else:
                mask = q_positions[rows, None] >= k_positions[None, cols]
                pairs.append(Pair(rows, cols, "masked", mask))
    return _joined(pairs)


def _joined(pairs: list[Pair]) -> list[Pair]:
    """Full pairs sharing their keys with adjacent queries, or their queries with adjacent keys, as one."""
    while True:
        found = next(((i, j, joined) for i, a in enumerate(pairs) for j, b in enumerate(pairs)
                      if i != j and (joined := _join(a, b)) is not None), None)
        if found is None:
            return pairs
        i, j, joined = found
        pairs = [pair for n, pair in enumerate(pairs) if n not in (i, j)] + [joined]


def _join(a: Pair, b: Pair) -> Pair | None:
    if a.kind != "full" or b.kind != "full":
        return None
    if a.k == b.k and a.q.stop == b.q.start:
        return Pair(slice(a.q.start, b.q.stop), a.k, "full")
    if a.q == b.q and a.k.stop == b.k.start:
        return Pair(a.q, slice(a.k.start, b.k.stop), "full")
    return None
