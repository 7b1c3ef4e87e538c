"""Point-to-point matching from the strategy's ledger: receives no send answers, sends nobody receives.

The flight recorder does not record send/recv on gloo, and pipelining is built on them; each rank's ledger says
what it issued (direction and microbatch as the tag) in its last step, which is enough to see a stage that never
sent what its neighbour waits for.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from diagnostics.records import PointToPointRecord, RankCapture


@dataclass(frozen=True)
class Unmatched:
    rank: int
    """The rank at fault: the sender that never sent, or the receiver that never received."""
    peer: int
    kind: str
    """never_sent or never_received."""
    role: str
    step: int
    tags: tuple[str, ...]
    """What is missing, e.g. ``("fwd/0",)``: the forward activations of microbatch 0."""
    skipped: bool = False
    """The sender went on to send later microbatches in the same direction: it skipped these, it was not blocked.
    A sender that is itself waiting on a receive and sent nothing later is a consequence, not the cause."""


def _issued(records: tuple[PointToPointRecord, ...], op: str, peer: int, step: int) -> Counter:
    return Counter(r.tag for r in records if r.op == op and r.peer == peer and r.step == step and r.state == "issued")


def unmatched(captures: dict[int, RankCapture]) -> list[Unmatched]:
    """For every pair of captured ranks that exchanged messages in a step both reached, what one side issued and
    the other did not. A receiver's extra receives name the sender; a sender's extra sends name the receiver."""
    found = []
    for rank, capture in captures.items():
        for peer in sorted({r.peer for r in capture.point_to_point}):
            other = captures.get(peer)
            if other is None or peer == rank:
                continue
            steps = {r.step for r in capture.point_to_point if r.peer == peer}
            steps &= {r.step for r in other.point_to_point if r.peer == rank}
            if not steps:
                continue
            step = max(steps)
            received = _issued(capture.point_to_point, "recv", peer, step)
            sent = _issued(other.point_to_point, "send", rank, step)
            missing = received - sent
            if missing and sum(received.values()) > sum(sent.values()):
                role = next(r.role for r in capture.point_to_point if r.peer == peer)
                found.append(Unmatched(peer, rank, "never_sent", role, step, tuple(sorted(missing)),
                                       _sent_later(sent, missing)))
            extra = sent - received
            if extra and sum(sent.values()) > sum(received.values()) and not (received - sent):
                role = next(r.role for r in other.point_to_point if r.peer == rank)
                found.append(Unmatched(rank, peer, "never_received", role, step, tuple(sorted(extra))))
    return found


def _chunk(tag: str) -> tuple[str, int]:
    direction, _, chunk = tag.partition("/")
    return direction, int(chunk) if chunk.isdigit() else -1


def _sent_later(sent: Counter, missing: Counter) -> bool:
    later = {_chunk(tag) for tag in sent}
    return any((d, c2) in later for d, c in map(_chunk, missing) for _, c2 in later if c2 > c >= 0)


def pending_receives(capture: RankCapture) -> list[PointToPointRecord]:
    """Receives this rank issued in its last step and never saw complete."""
    if not capture.point_to_point:
        return []
    step = max(r.step for r in capture.point_to_point)
    issued = Counter((r.peer, r.tag) for r in capture.point_to_point
                     if r.op == "recv" and r.step == step and r.state == "issued")
    done = Counter((r.peer, r.tag) for r in capture.point_to_point
                   if r.op == "recv" and r.step == step and r.state == "completed")
    left = issued - done
    return [r for r in capture.point_to_point if r.op == "recv" and r.step == step and r.state == "issued"
            and left.get((r.peer, r.tag), 0) > 0]
