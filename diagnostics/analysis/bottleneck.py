"""The bottleneck verdict from a window's recorded times: which part of the step to fix first (on which rank, or
over which mesh role), the numbers it rests on, and the advice a practitioner acts on (written by
`diagnostics.analysis.bottleneck_advice`).

Pure: the times come from ``diagnostics.callbacks.bottleneck_monitor`` (live) or ``diagnostics.analysis.trace``
(profiler traces). Nothing here imports torch, Lightning or ``lightning_nd``, so the offline CLI classifies a
window at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from statistics import median

from diagnostics.analysis.bottleneck_advice import Straggler, Window, advice, count, mean, percent, secs
from diagnostics.analysis.host_load import host_advice, oversubscribed
from diagnostics.records import PHASES, Diagnosis, RankTimes, WindowContext

Classifier = Callable[[Sequence[RankTimes], WindowContext], Diagnosis]
"""The type of `classify`, and of any classifier a user passes instead of it."""
STRAGGLER_PHASES = ("data_wait", "forward", "backward", "optimizer")
COMPUTE = ("forward", "backward", "optimizer")
NAMES = {"data_wait": "data wait", "pipeline_idle": "pipeline idle", "host": "host time (outside every phase)",
         "compute": "compute (forward, backward, optimizer)"}


@dataclass(frozen=True)
class Thresholds:
    """Where `classify` draws its lines, as shares of the mean step (over ranks)."""

    straggler_ratio: float = 1.3
    """A rank straggles in a phase when its time there is at least this times the median over its peers: every
    rank, or under pp > 1 the ranks of its pp stage (stages do different work), so a rank alone in its stage never
    straggles. With two peers the median is their mean: a rank twice as slow as the other is 2/1.5 = 1.33x it, so
    1.3 still catches it (1.3 catches any rank >= 1.86x the other there); with many ranks 1.3 is well above
    run-to-run noise."""
    straggler_share: float = 0.10
    """... and its excess over the median is at least this share of the step: a rank 2x slower in a phase that
    takes 1% of the step costs the others 1% at most, not worth a look."""
    data_share: float = 0.20
    """Data-bound when the loader's wait takes this share: a loader should hide entirely behind the step."""
    bubble_share: float = 0.20
    """Pipeline-bubble when stages idle this share: 1F1B at pp=2 with 4 microbatches already idles 20%."""
    comm_share: float = 0.30
    """Communication-bound when one role's exposed communication (with its waiting, absent a straggler) takes
    this share: some communication is the price of any layout; a third of the step is worth changing it for."""
    host_share: float = 0.30
    """Host-bound when the time outside every phase takes this share: Python and hooks, or a starved device."""
    residual_note: float = 0.05
    """The evidence mentions the residual (what the phases do not explain) when it exceeds this share."""


def waiting_by_role(ranks: Sequence[RankTimes], roles: dict[str, list[list[int]]]) -> dict[int, dict[str, float]]:
    """Rank -> role -> the part of its exposed communication on that role spent waiting for a slower member of its
    group: its time beyond the group's fastest member's (that one's time is the transfer). A role ``roles`` does not
    name (``other``; ``world`` when not given) has all of ``ranks`` as its one group; a rank in none of a named
    role's groups waits on it for nobody (its group is unknown, so nothing is blamed on others)."""
    by_rank = {times.rank: times for times in ranks}
    return {times.rank: {role: spent - _fastest(times.rank, role, by_rank, roles)
                         for role, spent in times.comm.items()} for times in ranks}


def _fastest(rank: int, role: str, by_rank: dict[int, RankTimes], roles: dict[str, list[list[int]]]) -> float:
    groups = roles[role] if role in roles else [list(by_rank)]
    members = {member for group in groups if rank in group for member in group} | {rank}
    return min(by_rank[m].comm[role] for m in members if m in by_rank and role in by_rank[m].comm)


def attribute_waiting(ranks: Sequence[RankTimes], roles: dict[str, list[list[int]]]) -> tuple[RankTimes, ...]:
    """The ranks with each collective's wait for slower group members moved from ``comm`` to
    ``phases['waiting']`` (`waiting_by_role`): what is left in ``comm`` is the transfer itself. The step, and so
    the residual, are unchanged."""
    return _moved(ranks, waiting_by_role(ranks, roles))


def _moved(ranks: Sequence[RankTimes], waits: dict[int, dict[str, float]]) -> tuple[RankTimes, ...]:
    return tuple(replace(times, comm={role: spent - waits[times.rank][role] for role, spent in times.comm.items()},
                         phases={**times.phases,
                                 "waiting": times.phases.get("waiting", 0.0) + sum(waits[times.rank].values())})
                 for times in ranks)


def _peer_groups(ranks: Sequence[RankTimes], context: WindowContext) -> list[tuple[int | None, list[RankTimes]]]:
    """(pp stage, its ranks): who a straggler is measured against. Pipeline stages do different work (the last
    holds the head and the loss), so under pp > 1 with the pp groups known (one rank per stage each, in stage
    order) a rank is compared only with the ranks of its stage, its index in its pp group; ranks in no pp group
    with each other (stage None). Otherwise every rank with every other, stage None."""
    groups = context.roles.get("pp", []) if context.dims.get("pp", 1) > 1 else []
    stages = {rank: index for group in groups for index, rank in enumerate(group)}
    if not stages:
        return [(None, list(ranks))]
    by_stage: dict[int | None, list[RankTimes]] = {}
    for times in ranks:
        by_stage.setdefault(stages.get(times.rank), []).append(times)
    return list(by_stage.items())


def _straggler(ranks: tuple[RankTimes, ...], context: WindowContext, step: float,
               thresholds: Thresholds) -> Straggler | None:
    """The (rank, phase) furthest above the phase's median over its peers (`_peer_groups`) that passes both
    straggler thresholds. A rank without peers (alone in its pp stage) has nobody to be slower than."""
    found = []
    for stage, peers in _peer_groups(ranks, context):
        if len(peers) < 2:
            continue
        for phase in STRAGGLER_PHASES:
            middle = median(times.phases.get(phase, 0.0) for times in peers)
            for times in peers:
                spent = times.phases.get(phase, 0.0)
                excess = spent - middle
                if (excess > 0 and spent >= thresholds.straggler_ratio * middle
                        and excess >= thresholds.straggler_share * step):
                    found.append(Straggler(times.rank, phase, spent, middle, excess, len(peers), stage))
    return max(found, key=lambda s: s.excess, default=None)


def _window(ranks: Sequence[RankTimes], context: WindowContext,
            thresholds: Thresholds) -> tuple[Window, Straggler | None]:
    waits = waiting_by_role(ranks, context.roles)
    moved = _moved(ranks, waits)
    step = mean([t.step_s for t in moved])
    roles = list(dict.fromkeys(role for times in moved for role in times.comm))
    seconds = {phase: mean([t.phases.get(phase, 0.0) for t in moved]) for phase in PHASES}
    seconds |= {f"comm:{role}": mean([t.comm.get(role, 0.0) for t in moved]) for role in roles}
    seconds |= {"compute": sum(seconds[phase] for phase in COMPUTE), "residual": mean([t.residual_s for t in moved])}
    straggler = _straggler(moved, context, step, thresholds)
    comm = {role: seconds[f"comm:{role}"] + (0.0 if straggler else mean([waits[t.rank].get(role, 0.0) for t in moved]))
            for role in roles}
    return Window(moved, context, step, seconds, comm), straggler


def _verdict(window: Window, thresholds: Thresholds) -> tuple[str, str, bool]:
    """(label, the part it rests on, whether a threshold was passed) for a window without a straggler."""
    largest_comm = [f"comm:{max(window.comm, key=window.comm.get)}"] if window.comm else []
    rules = [("data-bound", "data_wait", thresholds.data_share),
             ("pipeline-bubble", "pipeline_idle", thresholds.bubble_share),
             *(("communication-bound", part, thresholds.comm_share) for part in largest_comm),
             ("host-bound", "host", thresholds.host_share)]
    for label, part, floor in rules:
        if window.share(window.part_seconds(part)) >= floor:
            return label, part, True
    parts = [("compute-bound", "compute")] + [(label, part) for label, part, _ in rules]
    label, part = max(parts, key=lambda item: window.part_seconds(item[1]))
    return label, part, False


def _evidence(window: Window, part: str, straggler: Straggler | None, passed: bool) -> str:
    step, over = secs(window.step), count(len(window.ranks))
    if straggler:
        ratio = f" ({straggler.seconds / straggler.median:.1f}x)" if straggler.median > 0 else ""
        return (f"rank {straggler.rank} takes {secs(straggler.seconds)} s in {straggler.phase} against a median"
                f" {secs(straggler.median)} s over {straggler.among()}{ratio}: {secs(straggler.excess)} s more, "
                f"{percent(window.share(straggler.excess))} of the {step} s step")
    role = part.removeprefix("comm:")
    name = f"{role} communication" if part.startswith("comm:") else NAMES.get(part, part)
    seconds = window.part_seconds(part)
    waited = seconds - window.seconds[part] if part.startswith("comm:") else 0.0
    of_it = f", {secs(waited)} s of it waiting for slower ranks" if waited > 0 else ""
    below = "" if passed or part == "compute" else ": the largest part, though under its threshold"
    return (f"{name} takes {percent(window.share(seconds))} of the step ({secs(seconds)} s of {step} s, mean over"
            f" {over}{of_it}){below}")


def _residual_note(window: Window, note: float) -> str:
    residual, seconds = window.share(window.seconds["residual"]), secs(window.seconds["residual"])
    if abs(residual) <= note:
        return ""
    if residual < 0:
        return f"; the phases add up to {percent(-residual)} more than the step (residual {seconds} s)"
    return f"; {percent(residual)} of the step ({seconds} s) is in no recorded phase (residual, not classified)"


def classify(ranks: Sequence[RankTimes], context: WindowContext, thresholds: Thresholds = Thresholds()) -> Diagnosis:
    """The default `Classifier`. Each collective's wait for slower ranks becomes ``waiting`` first
    (`attribute_waiting`); then the first rule that holds gives the label:

    1. straggler: one rank slow in a compute or data phase against its peers (under pp, the ranks of its stage).
       First, because every other rank's waiting and communication is its doing: fixing them while it lags buys
       nothing.
    2. data-bound: the loader starves every phase behind it, and its fixes are the cheapest.
    3. pipeline-bubble: idle time the schedule and microbatch count set, fixed by a setting alone.
    4. communication-bound: the largest role's share, its waiting counted in (balanced ranks waiting on each other
       inside a collective pay for that dim); changing it means changing the layout.
    5. host-bound: time outside every phase, last because it also absorbs whatever the probe did not see.

    Otherwise the largest of compute, data wait, pipeline idle, the largest role and host gives the label. The
    residual is never a class: it is reported in ``residual`` and mentioned past ``residual_note``."""
    if not ranks:
        raise ValueError("classify got no ranks' times: the window recorded no step. HINT: classify a window of at"
                         " least one completed optimizer step (a longer window, or one that ends after a step).")
    window, straggler = _window(ranks, context, thresholds)
    shares = {key: window.share(seconds) for key, seconds in window.seconds.items()}
    residual = shares["residual"]
    if window.step <= 0:
        return Diagnosis("compute-bound", shares, f"the window's steps took no measurable time (mean step"
                         f" {secs(window.step)} s over {count(len(ranks))}): nothing to classify",
                         ("record a window over more steps, with the step timer running",), residual=residual)
    if straggler:
        label, part, passed = "straggler", straggler.phase, True
    else:
        label, part, passed = _verdict(window, thresholds)
    if label == "compute-bound" and len(ranks) > 1 and context.profiled is False:
        return _unsplit(window, shares, residual)
    evidence = _evidence(window, part, straggler, passed) + _residual_note(window, thresholds.residual_note)
    dim = part.removeprefix("comm:") if label == "communication-bound" else None
    findings, told = oversubscribed(context), advice(label, part, window, straggler)
    if findings:
        # A shared host stretches every phase and makes every rank wait: when the verdict is compute, the host is
        # what to change (tuning the compute with bf16 or compile against time-sliced numbers is advice for another
        # machine); a straggler, the loader or a layout's communication stand on their own, the host comes after.
        told = (host_advice(context),) if label == "compute-bound" else (*told, host_advice(context))
    return Diagnosis(label, shares, evidence, told, dim=dim, rank=straggler.rank if straggler else None,
                     phase=straggler.phase if straggler else None, residual=residual, findings=findings)


def _unsplit(window: Window, shares: dict[str, float], residual: float) -> Diagnosis:
    """Several ranks, no profiled step: a collective's wait for a slower rank sits inside forward and backward on
    every rank alike, so neither a straggler nor communication shows, and "compute-bound" would be a guess."""
    steps = min(times.steps for times in window.ranks)
    evidence = (f"no step of this window ({window.context.first_step}-{window.context.last_step}, {steps} steps"
                f" measured over {count(len(window.ranks))}) was profiled, so the time inside collectives (and the"
                f" wait for a slower rank) cannot be told from compute: forward, backward and optimizer take"
                f" {percent(window.share(window.seconds['compute']))} of the {secs(window.step)} s step, with it in")
    advice = ("profile a step of each window: BottleneckMonitor(every_n_steps=N, profile=True) with N at most half the"
              " run's steps (a window of a run shorter than N ends with a profiled step when the Trainer knows its"
              " length: max_steps or max_epochs)",)
    return Diagnosis("not-enough-evidence", shares, evidence, advice, residual=residual)


__all__ = ["Classifier", "Thresholds", "attribute_waiting", "classify", "waiting_by_role"]
