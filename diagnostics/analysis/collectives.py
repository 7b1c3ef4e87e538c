"""Cross-rank matching of flight-recorder entries, per process group: who is behind, who skipped, who disagrees.

Gloo pairs a group's collectives by a per-group call counter, so a rank that skips one does not hang there:
its later collectives pair with its peers' earlier ones. Sequence numbers are therefore not trusted alone: each
rank's entries are aligned to the group's majority by signature (op, sizes, dtypes, call site), which tells a rank
that is behind (a prefix of the others) from one that skipped (the others' sequence with holes) and from one that
issued something else at the same position (a mismatch). Where a group has no majority (two members), the same
position in the other groups of the same mesh dim decides.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from diagnostics.records import CollectiveEntry, Frame, GroupRecord, RankCapture

UNEVEN_PREFIXES = ("all_to_all", "alltoall")  # MoE token exchange: each rank's splits are its own
ROOTED_OPS = ("gather", "scatter")  # only the root holds the whole buffer


@dataclass(frozen=True)
class GroupTrace:
    """One process group across the ranks that captured it."""

    name: str
    role: str
    ranks: tuple[int, ...]
    entries: dict[int, dict[int, CollectiveEntry]]
    """Captured member -> sequence number -> entry."""

    @property
    def front(self) -> int:
        return max((max(seqs, default=0) for seqs in self.entries.values()), default=0)


@dataclass(frozen=True)
class CollectiveDivergence:
    """Where one captured member's collectives part from its group's majority sequence."""

    rank: int
    kind: str
    """behind, skipped, mismatch."""
    group: GroupTrace
    seq: int
    expected: CollectiveEntry | None
    """What the majority issued at ``seq``."""
    issued: CollectiveEntry | None
    """What this rank issued there (None when it never got that far)."""
    skipped: int = 0


LIBRARY_PATHS = ("/torch/", "/lightning/", "/lightning_fabric/", "/pytorch_lightning/", "/lightning_nd/",
                 "/diagnostics/", "/threading.py", "/concurrent/", "<frozen", "/contextlib.py", "/functools.py",
                 "/tests/worker.py", "/runpy.py")


def user_frame(frames: Iterable[Frame]) -> Frame | None:
    """The innermost frame outside torch, Lightning and this project (the user's line), else the innermost."""
    frames = tuple(frames)
    return next((f for f in frames if not any(part in f.file for part in LIBRARY_PATHS)), frames[0] if frames else None)


def signature(entry: CollectiveEntry) -> tuple:
    """What must agree between the ranks of one call: op, sizes and dtypes (not for uneven ops: a scatter's
    non-root ranks have no input at all), and the call site as the user sees it (`user_frame`). The frames inside
    torch and Lightning are not compared: the same barrier reached through another path of Lightning's loop (an
    epoch that ended on one rank and not yet on another) is the same call, and it pairs as one."""
    uneven = entry.op.startswith(UNEVEN_PREFIXES) or entry.op in ROOTED_OPS
    buffers = () if uneven else (entry.input_sizes, entry.input_dtypes)
    site = user_frame(entry.frames)
    return entry.op, buffers, (site.file, site.line) if site is not None else None


def group_traces(captures: dict[int, RankCapture]) -> list[GroupTrace]:
    """Each process group (by name and members) with every captured member's entries."""
    known: dict[tuple[str, tuple[int, ...]], GroupRecord] = {}
    entries: dict[tuple[str, tuple[int, ...]], dict[int, dict[int, CollectiveEntry]]] = {}
    for rank, capture in captures.items():
        by_name = {g.name: g for g in capture.groups}
        for group in capture.groups:
            key = (group.name, group.ranks)
            if key not in known or _preference(group.role) < _preference(known[key].role):
                known[key] = group  # one process group serving several roles: name it by the most specific
            entries.setdefault(key, {}).setdefault(rank, {})
        for entry in capture.entries:
            group = by_name.get(entry.group)
            if group is not None:
                entries[(group.name, group.ranks)][rank][entry.seq] = entry
    return [GroupTrace(key[0], known[key].role, key[1], entries[key]) for key in sorted(known, key=str)
            if any(entries[key].values())]


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


def _preference(role: str) -> int:
    """Mesh dims first, then the flattened roles, the world group last."""
    return 0 if role.split(".")[0] in MESH_DIMS else 2 if role == "world" else 1


def _majority(group: GroupTrace, seq: int, votes: dict[tuple, Counter], context: tuple) -> tuple | None:
    """The group's majority signature at ``seq``; without one (a tie, or a single member captured), the same
    position in the other groups of its dim and pipeline stages, when those agree with each other."""
    own = Counter(signature(seqs[seq]) for seqs in group.entries.values() if seq in seqs)
    if not own:
        return None
    ranked = own.most_common()
    if len(ranked) == 1 and ranked[0][1] > 1 or len(ranked) > 1 and ranked[0][1] > ranked[1][1]:
        return ranked[0][0]
    others = votes.get((group.role, context, seq), Counter()) - own
    if others:
        best, count = others.most_common(1)[0]
        if count >= 2 and (best in own or sum(own.values()) == 1 or len(ranked) > 1):
            return best
    return ranked[0][0] if len(ranked) == 1 else None


def _context(group: GroupTrace, stage_of: dict[int, int]) -> tuple:
    """Groups compared with each other: same dim, same pipeline stages (other stages run other layers)."""
    return tuple(sorted({stage_of.get(rank, 0) for rank in group.ranks}))


def _role_votes(traces: list[GroupTrace], stage_of: dict[int, int]) -> tuple[dict[tuple, Counter], dict]:
    """Signatures by (dim, stages, seq) over every group, and one entry of each signature."""
    votes: dict[tuple, Counter] = {}
    examples: dict[tuple, CollectiveEntry] = {}
    for group in traces:
        context = _context(group, stage_of)
        for seqs in group.entries.values():
            for seq, entry in seqs.items():
                votes.setdefault((group.role, context, seq), Counter())[signature(entry)] += 1
                examples.setdefault(signature(entry), entry)
    return votes, examples


def compare_groups(traces: list[GroupTrace], stage_of: dict[int, int] | None = None) -> list[CollectiveDivergence]:
    """Per group, each captured member against the group's majority sequence (``stage_of``: rank -> pp coordinate)."""
    stage_of = stage_of or {}
    votes, examples = _role_votes(traces, stage_of)
    divergences = []
    for group in traces:
        front, context = group.front, _context(group, stage_of)
        # The sequence numbers some member recorded (a ring of the last entries: a long run's start at millions).
        recorded = sorted({seq for seqs in group.entries.values() for seq in seqs})
        reference = {seq: _majority(group, seq, votes, context) for seq in recorded}
        example = {seq: examples.get(reference[seq]) for seq in reference}
        for rank, seqs in group.entries.items():
            if not seqs:
                continue
            last = max(seqs)
            diverged = next((s for s in sorted(seqs) if reference.get(s) is not None
                             and signature(seqs[s]) != reference[s]), None)
            if diverged is None:
                tie = _unsettled_tie(group, reference, rank)
                if tie is not None:
                    divergences.append(tie)
                elif last < front and example.get(last + 1) is not None:
                    divergences.append(CollectiveDivergence(rank, "behind", group, last + 1, example[last + 1], None))
                continue
            shift = _shift(seqs, reference, diverged, last, front)
            if shift:
                divergences.append(CollectiveDivergence(rank, "skipped", group, diverged, example.get(diverged), None,
                                                        shift))
            else:
                divergences.append(CollectiveDivergence(rank, "mismatch", group, diverged, example.get(diverged),
                                                        seqs[diverged]))
    return divergences


def _unsettled_tie(group: GroupTrace, reference: dict[int, tuple | None], rank: int) -> CollectiveDivergence | None:
    """Two members disagree where the group stopped (its front), with no majority and no other group of the dim to
    settle it: both are named. Earlier ties are left alone: the run went past them, so they are not what broke."""
    for seq in (group.front,):
        if reference.get(seq, 0) is not None or seq not in group.entries[rank]:
            continue
        issued = group.entries[rank][seq]
        other = next((seqs[seq] for member, seqs in group.entries.items() if member != rank and seq in seqs
                      and signature(seqs[seq]) != signature(issued)), None)
        if other is not None:
            return CollectiveDivergence(rank, "mismatch", group, seq, other, issued)
    return None


def _shift(seqs: dict[int, CollectiveEntry], reference: dict[int, tuple | None], diverged: int, last: int,
           front: int) -> int:
    """The number of collectives a rank skipped: the smallest k for which its entries from ``diverged`` on are the
    majority's from ``diverged + k`` on (where the majority got that far; past it the rank went on alone)."""
    mine = [s for s in sorted(seqs) if diverged <= s <= last]
    for k in range(1, min(front - diverged, len(reference)) + 1):  # a ring's window: no shift past what it holds
        overlap = [s for s in mine if s + k <= front and reference.get(s + k)]
        if overlap and all(signature(seqs[s]) == reference[s + k] for s in overlap):
            return k
    return 0


def pending(group: GroupTrace, rank: int) -> CollectiveEntry | None:
    """The entry ``rank`` is blocked in on this group (its last, not retired), if any."""
    seqs = group.entries.get(rank) or {}
    if not seqs:
        return None
    entry = seqs[max(seqs)]
    return None if entry.retired else entry
