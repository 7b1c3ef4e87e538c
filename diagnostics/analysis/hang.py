"""The hang verdict in mesh terms, from whatever the ranks left: their flight-recorder entries, stacks, ledgers, and
which ranks died (``dead``: from the heartbeats, or a capture that never came).

Evidence ranks by strength: a rank that issued something else than its peers (mismatch), skipped a collective or a
pipeline send, beats a rank found elsewhere than where its peers wait for it (stuck, with its line), which beats a
dead rank (its peers' dumps say what it last joined). Ranks that wait for a culprit are consequences, not culprits.
"""

from __future__ import annotations

from collections.abc import Iterable

from diagnostics.analysis.collectives import (
    CollectiveDivergence,
    GroupTrace,
    compare_groups,
    group_traces,
    pending,
    user_frame,
)
from diagnostics.analysis.point_to_point import Unmatched, pending_receives, unmatched
from diagnostics.records import CollectiveEntry, Culprit, HangReport, RankCapture


def coordinates_text(rank: int, coordinates: dict[str, dict[str, int]]) -> str:
    """``rank 3 (pp 0, dp_shard 1, tp 1)``: the dims of size one (every rank at 0) left out."""
    coords = coordinates.get(str(rank)) or {}
    used = {dim for values in coordinates.values() for dim, value in values.items() if value}
    shown = ", ".join(f"{dim} {value}" for dim, value in coords.items() if dim in used)
    return f"rank {rank} ({shown})" if shown else f"rank {rank}"


def _waited(group: GroupTrace, captures: dict[int, RankCapture], excluding: int) -> float | None:
    """How long the members at the group's front had been in their last collective when they were captured."""
    waits, front = [], group.front
    for rank, seqs in group.entries.items():
        entry = seqs.get(front)
        if rank != excluding and entry is not None and entry.started_ns:
            waits.append(captures[rank].captured_at - entry.started_ns / 1e9)
    return round(max(waits), 1) if waits else None


def _op(entry: CollectiveEntry | None) -> str:
    return entry.op if entry is not None else "?"


def _call_site(entry: CollectiveEntry | None) -> str | None:
    frame = user_frame(entry.frames) if entry is not None else None
    return str(frame) if frame else None


def _call(entry: CollectiveEntry | None) -> str:
    if entry is None:
        return "nothing"
    sizes = ", ".join("x".join(map(str, size)) or "scalar" for size in entry.input_sizes)
    return f"{entry.op}({sizes}; {','.join(entry.input_dtypes)}) at {_call_site(entry)}"


def _busy(rank: int, captures: dict[int, RankCapture], traces: list[GroupTrace]) -> bool:
    """The rank is itself blocked in a collective or a receive: it waits for someone else."""
    capture = captures[rank]
    if capture.raised and not capture.error:
        return True
    if any("/torch/distributed/" in frame.file for frame in capture.stacks.get(capture.main_thread, ())):
        return True
    if any(pending(group, rank) is not None for group in traces if rank in group.entries):
        return True
    if any(_waits_in(group, rank) for group in traces):
        return True
    return bool(pending_receives(capture))


def _waits_in(group: GroupTrace, rank: int) -> bool:
    """The rank is at the group's front while another member is behind: it waits there (a wait-for edge, seen in
    the entries alone, even when a timeout has marked its last one retired or no stack was captured)."""
    seqs = group.entries.get(rank) or {}
    if not seqs or max(seqs) != group.front:
        return False
    return any(other and max(other) < group.front for member, other in group.entries.items() if member != rank)


def _where(capture: RankCapture) -> str | None:
    frame = user_frame(capture.stacks.get(capture.main_thread, ()))
    return str(frame) if frame else None


def _from_divergence(divergence: CollectiveDivergence, captures: dict[int, RankCapture]) -> Culprit:
    group, rank = divergence.group, divergence.rank
    waited = _waited(group, captures, rank)
    if divergence.kind == "mismatch":
        issued, expected = divergence.issued, divergence.expected
        detail = f"it issued {_call(issued)} where its peers issued {_call(expected)}"
        return Culprit(rank, "mismatch", group.role, group.ranks, _op(issued), divergence.seq, _call_site(issued),
                       waited, detail)
    if divergence.kind == "skipped":
        detail = (f"its later collectives paired with its peers' earlier ones ({divergence.skipped} behind), so"
                  " they carried the wrong data or failed")
        return Culprit(rank, "skipped", group.role, group.ranks, _op(divergence.expected), divergence.seq,
                       _call_site(divergence.expected), waited, detail)
    where = _where(captures[rank])
    return Culprit(rank, "stuck", group.role, group.ranks, _op(divergence.expected), divergence.seq, where, waited,
                   f"never joined it; its main thread is at {where}")


def _from_unmatched(item: Unmatched, captures: dict[int, RankCapture], roles: dict[int, dict[str, tuple]],
                    traces: list[GroupTrace]) -> Culprit:
    group = roles.get(item.rank, {}).get(item.role, (item.rank, item.peer))
    idle = item.rank in captures and not _busy(item.rank, captures, traces)
    where = _where(captures[item.rank]) if idle else None
    verb = "never sent" if item.kind == "never_sent" else "never received"
    direction = "to" if item.kind == "never_sent" else "from"
    detail = f"{verb} {', '.join(item.tags)} of step {item.step} {direction} rank {item.peer}"
    return Culprit(item.rank, item.kind, item.role, tuple(group), "send" if item.kind == "never_sent" else "recv",
                   None, where, None, detail)


def _absent(rank: int, captures: dict[int, RankCapture], traces: list[GroupTrace],
            roles: dict[int, dict[str, tuple]], died: bool) -> Culprit:
    """A rank without a capture, named from its peers' entries: dead (the watchdog said so), or silent."""
    kind, what = ("dead", "died") if died else ("no_capture", "left no capture")
    awaited = [(c.rank, r) for c in captures.values() for r in pending_receives(c) if r.peer == rank]  # ledgers
    what += f" ({'; '.join(f'rank {r} waited for its {p.tag or p.op} (step {p.step})' for r, p in awaited)})" \
        if awaited else ""
    groups = [group for group in traces if rank in group.ranks and group.role != "world"] or \
             [group for group in traces if rank in group.ranks]
    waiting = [(group, entry) for group in groups for r in group.entries if (entry := pending(group, r)) is not None]
    if waiting:
        group, entry = min(waiting, key=lambda item: item[1].started_ns or 0)
        # its peers got to #seq, so #seq-1 completed, and a collective completes only once every member joined
        joined = next((seqs[entry.seq - 1] for seqs in group.entries.values() if entry.seq - 1 in seqs), None)
        last = f"; it last joined {_call(joined)} #{joined.seq}" if joined else ""
        detail = f"{what}; its peers waited for it in {_call(entry)} #{entry.seq}{last}"
        return Culprit(rank, kind, group.role, group.ranks, entry.op, entry.seq, _call_site(entry),
                       _waited(group, captures, rank), detail)
    if not groups and awaited:  # no collective with it recorded: its pipeline (or ring) group says where
        role = awaited[0][1].role
        members = roles.get(rank, {}).get(role, (rank, awaited[0][0]))
        return Culprit(rank, kind, role, members, "send", None, None, None, what)
    group = groups[0] if groups else None
    seqs = [e for member in (group.entries.values() if group else ()) for e in member.values()]
    last = max(seqs, key=lambda e: e.seq) if seqs else None
    detail = f"{what}; the last collective its peers recorded with it: {_call(last)} #{last.seq}" if last else what
    return Culprit(rank, kind, group.role if group else "world", group.ranks if group else (), _op(last),
                   last.seq if last else None, _call_site(last), None, detail)


def _failed(capture: RankCapture) -> Culprit:
    """A rank whose own step raised (not a communication error): it stopped, its peers then waited for it."""
    group = next((g for g in capture.groups if g.role != "world"), None)
    return Culprit(capture.rank, "failed", group.role if group else "world", group.ranks if group else (), "-", None,
                   None, None, f"failed by itself: {capture.error}")


def _role_groups(captures: dict[int, RankCapture]) -> dict[int, dict[str, tuple]]:
    roles: dict[int, dict[str, tuple]] = {}
    for capture in captures.values():
        for group in capture.groups:
            for rank in group.ranks:
                roles.setdefault(rank, {}).setdefault(group.role, group.ranks)
    return roles


def _sentence(culprit: Culprit, coordinates: dict[str, dict[str, int]]) -> str:
    who = coordinates_text(culprit.rank, coordinates)
    on = f"on the {culprit.dim} group {list(culprit.group_ranks)}"
    seq = f" #{culprit.seq}" if culprit.seq is not None else ""
    waited = f"; its peers waited {culprit.waited_s:.0f} s" if culprit.waited_s is not None else ""
    if culprit.kind == "stuck":
        where = f"it is at {culprit.frame}" if culprit.frame else "its stack was not captured"
        return f"{who} never joined {culprit.op}{seq} {on}; {where}{waited}"
    if culprit.kind == "skipped":
        return f"{who} skipped {culprit.op}{seq} {on} (called at {culprit.frame}); {culprit.detail}{waited}"
    if culprit.kind == "mismatch":
        return f"{who} disagrees with its peers at {culprit.op}{seq} {on}: {culprit.detail}{waited}"
    if culprit.kind in ("never_sent", "never_received"):
        where = f"; it is at {culprit.frame}" if culprit.frame else ""
        return f"{who} {culprit.detail} ({culprit.dim} group {list(culprit.group_ranks)}){where}"
    if culprit.kind == "failed":
        return f"{who} {culprit.detail}"
    return f"{who} {culprit.detail} {on}{waited}"


def hang_report(captures: dict[int, RankCapture], world_size: int, dead: Iterable[int] = (),
                reason: str = "") -> HangReport:
    """Who is at fault and where, in mesh terms, from every capture there is (pure: recorded data only).
    ``dead``: ranks the watchdog found dead; other ranks without a capture are named as such, not as dead."""
    traces = group_traces(captures)
    coordinates = next((c.coordinates for c in captures.values() if c.coordinates), {})
    stage_of = {int(rank): coords.get("pp", 0) for rank, coords in coordinates.items()}
    divergences = compare_groups(traces, stage_of)
    p2p = unmatched(captures)
    roles = _role_groups(captures)
    dead = sorted(set(dead))
    missing = [rank for rank in range(world_size) if rank not in captures]
    evidence = [_failed(c) for c in captures.values() if c.error]
    evidence += [_from_divergence(f, captures) for f in divergences if f.kind in ("mismatch", "skipped")]
    evidence += [_from_unmatched(u, captures, roles, traces) for u in p2p if u.kind == "never_sent" and u.skipped]
    elsewhere = [_from_divergence(f, captures) for f in divergences
                 if f.kind == "behind" and not _busy(f.rank, captures, traces)]
    elsewhere += [_from_unmatched(u, captures, roles, traces) for u in p2p
                  if not u.skipped and u.rank in captures and not _busy(u.rank, captures, traces)]
    absent = [_absent(rank, captures, traces, roles, rank in dead) for rank in sorted(set(dead) | set(missing))]
    culprits = evidence or elsewhere or absent
    if not culprits:  # everyone waits for someone: name the ranks that are behind, and where they wait
        culprits = [_from_divergence(f, captures) for f in divergences if f.kind == "behind"]
    unique: dict[int, Culprit] = {}
    for culprit in sorted(culprits, key=lambda c: -(c.waited_s or 0)):
        unique.setdefault(culprit.rank, culprit)
    culprits = sorted(unique.values(), key=lambda c: c.rank)
    summary = [_sentence(c, coordinates) for c in culprits]
    summary += [f"{_sentence(a, coordinates)} (a consequence)" for a in absent if a.rank not in unique]
    summary += [f"rank {c.rank} had no flight recorder (TORCH_FR_BUFFER_SIZE=0?): judged from its stack only"
                for c in captures.values() if not c.flight_recorder]
    return HangReport(tuple(culprits), tuple(dead), tuple(sorted(captures)), tuple(missing), tuple(summary), reason)
