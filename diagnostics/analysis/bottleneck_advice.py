"""What to do about a bottleneck verdict: the advice `diagnostics.analysis.bottleneck.classify` attaches, in
practitioners' terms and with the window's numbers, leaving out what the run already does
(`WindowContext.options`: its precision, compile and activation checkpointing).

Apart from the classifier so each reads on its own; it holds what both read: the window's means (`Window`), the
straggler found in them (`Straggler`) and how numbers are written. Pure like the classifier: the bubble
advice reads the schedule's stages per rank from the record (the Layout resolved it: 1 for gpipe and 1f1b)
and prices more microbatches with the formula itself, importing nothing of the run.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from diagnostics.records import RankTimes, WindowContext

BUBBLE_TARGET = 0.12
"""The theoretical bubble the microbatch advice aims under: past it, more microbatches buy little."""
LIGHTER_CHECKPOINTING = {"full": "'selective' or 'none'", "selective": "'none'"}
"""Activation checkpointing mode -> the modes that recompute less."""


@dataclass(frozen=True)
class Straggler:
    """A rank slow in one phase against the median of its peers (the ranks it is compared with)."""

    rank: int
    phase: str
    seconds: float
    median: float
    excess: float
    peers: int
    """How many ranks the median is over, the straggler among them."""
    stage: int | None = None
    """The pp stage the peers share, when the straggler was sought stage by stage."""

    def among(self) -> str:
        """``2 ranks of pp stage 1``: who the median is over."""
        return count(self.peers) + ("" if self.stage is None else f" of pp stage {self.stage}")


@dataclass(frozen=True)
class Window:
    """The window's means, in seconds: ``seconds`` per `Diagnosis.shares` key, ``comm`` per role as the
    communication rule sees it (its waiting counted in, absent a straggler)."""

    ranks: tuple[RankTimes, ...]
    context: WindowContext
    step: float
    seconds: dict[str, float]
    comm: dict[str, float]

    def share(self, seconds: float) -> float:
        return seconds / self.step if self.step > 0 else 0.0

    def part_seconds(self, part: str) -> float:
        return self.comm[part.removeprefix("comm:")] if part.startswith("comm:") else self.seconds[part]


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def count(ranks: int) -> str:
    return f"{ranks} rank" + ("" if ranks == 1 else "s")


def percent(share: float) -> str:
    return f"{round(share * 100)}%"


def secs(seconds: float) -> str:
    """2-3 significant digits: ``12``, ``1.5``, ``0.21``, ``0.012``."""
    size = abs(seconds)
    return f"{seconds:.0f}" if size >= 10 else f"{seconds:.1f}" if size >= 1 else (
        f"{seconds:.2f}" if size >= 0.1 else f"{seconds:.2g}")


def advice(label: str, part: str, window: Window, straggler: Straggler | None) -> tuple[str, ...]:
    """`Diagnosis.advice` for a verdict: ``label`` resting on ``part`` (a `Diagnosis.shares` key)."""
    if straggler:
        return _straggler_advice(straggler, window)
    share = percent(window.share(window.part_seconds(part)))
    spent = secs(window.part_seconds(part))
    options = window.context.options
    if label == "communication-bound":
        return _comm_advice(part.removeprefix("comm:"), share, window.context)
    if label == "pipeline-bubble":
        return _bubble_advice(share, window.context)
    if label == "data-bound":
        workers = window.context.num_workers
        now = "" if workers is None else f" (now {workers})"
        return (f"data wait {share} of the step ({spent} s): raise num_workers{now} so batches are ready before the"
                " step asks, with pin_memory=True and persistent_workers=True",
                "move per-sample work (tokenising, decoding, augmenting) out of the loader: pre-process the data once")
    if label == "host-bound":
        head = f"host time {share} of the step ({spent} s outside every phase)"
        hooks = "fewer per-step Python hooks and less logging (log every n steps, no sync_dist=True each step)"
        lines = ([f"{head}, the blocks compiled already: {hooks}"] if options.get("compile") else
                 [f"{head}: compile the blocks with NDParallel(compile=True), so fewer, larger kernels leave Python"
                  " less to launch", hooks])
        return (*lines, "a larger batch per step, so the same host time is spread over more work")
    return _compute_advice(share, window.context)


LOW_MFU = 0.05
"""Below this model-FLOPs utilisation the compute phases are dominated by per-operation costs (kernel launches,
Python, DTensor dispatch), which a cheaper matmul does not remove."""


def _compute_advice(share: str, context: WindowContext) -> tuple[str, ...]:
    """Cheaper compute, each fix only where the options do not show it on already: any precision naming 16 (bf16
    or fp16) already halves the matmuls' cost, and recomputing less is only possible under checkpointing."""
    options = context.options
    mfu = f", MFU {context.mfu * 100:.2g}%" if context.mfu is not None else ""
    if context.mfu is not None and context.mfu < LOW_MFU:
        lines = [f"the compute phases take {share} of the step{mfu}: at so low an MFU they are mostly per-operation"
                 " overhead, not FLOPs: a larger batch per rank (or fewer tp/cp splits of small matrices) gives each"
                 " operation more work"]
    else:
        lines = [f"the run is compute-bound (compute {share} of the step{mfu}): a faster layout will not help much;"
                 " make the compute cheaper"]
    if "16" not in str(options.get("precision") or ""):
        lines.append("bf16 mixed precision: Trainer(precision='bf16-mixed')")
    checkpointing = options.get("activation_checkpointing")
    if checkpointing in LIGHTER_CHECKPOINTING:
        lines.append(f"less activation recomputation if memory allows: activation_checkpointing="
                     f"{LIGHTER_CHECKPOINTING[checkpointing]} (now {checkpointing!r})")
    if not options.get("compile"):
        lines.append("torch.compile: NDParallel(compile=True)")
    return tuple(lines)


def _straggler_advice(straggler: Straggler, window: Window) -> tuple[str, ...]:
    others = [t.phases["waiting"] for t in window.ranks if t.rank != straggler.rank]
    ratio = f"{straggler.seconds / straggler.median:.1f}x slower" if straggler.median > 0 else "slower"
    stage = "" if straggler.stage is None else f" of pp stage {straggler.stage}"
    host = window.context.hosts.get(straggler.rank)
    where = f"rank {straggler.rank}'s host" + (f" ({host})" if host else "")
    cause = (f"its loader is slower: look at {where} (its storage, CPU load, num_workers)"
             if straggler.phase == "data_wait" else
             f"look at {where} (another process on it, thermal or power throttling, a slower link)")
    return (f"rank {straggler.rank} is {ratio} in {straggler.phase} ({secs(straggler.seconds)} s vs a median"
            f" {secs(straggler.median)} s{stage}); the other ranks wait {percent(window.share(mean(others)))} of the"
            f" step for it: {cause}",)


def _smaller(name: str, size: int) -> str:
    return f"{name}={size // 2}" if size >= 2 and size % 2 == 0 else f"a smaller {name}"


def _spanning(role: str, context: WindowContext) -> str | None:
    """``ranks 0, 1, 2, 3 on a, b`` for the first group of the role with members on more than one host."""
    for group in context.roles.get(role, []):
        hosts = sorted({context.hosts[rank] for rank in group if rank in context.hosts})
        if len(hosts) > 1:
            return f"ranks {', '.join(map(str, group))} on {', '.join(hosts)}"
    return None


def _per_host(hosts: dict[int, str]) -> str:
    """``8 ranks per host`` (``4 to 8 ranks per host`` when hosts differ): the largest group that fits in one."""
    held = Counter(hosts.values()).values()
    least, most = min(held), max(held)
    return f"{count(least)} per host" if least == most else f"{least} to {most} ranks per host"


def _comm_advice(role: str, share: str, context: WindowContext) -> tuple[str, ...]:
    dims = {name: context.dims.get(name, 1) for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")}
    span = _spanning(role, context)
    across = [f"{role} spans hosts ({span}): keep {role} inside a node ({_per_host(context.hosts)}), where its"
              " collectives use the fast local links"] if span else []
    tp, shard, replicate = dims["tp"], dims["dp_shard"], dims["dp_replicate"]
    if role == "tp":
        fix = (f"try tp={tp // 2} with pp={2 * dims['pp']} (or dp_shard={2 * shard})" if tp >= 2 and tp % 2 == 0
               else "try a smaller tp, pp or dp_shard making up the ranks")
        text = f"tp={tp} collectives take {share} of the step: {fix}"
    elif role in ("fsdp", "hsdp"):
        hsdp = (f"HSDP (dp_replicate={2 * replicate}, dp_shard={shard // 2}) shards over fewer ranks"
                if shard >= 2 and shard % 2 == 0 else "fewer shards (HSDP with dp_replicate)")
        text = (f"FSDP's all-gathers and reduce-scatters over dp_shard x cp = {shard * dims['cp']} ranks take {share}"
                f" of the step: a larger batch per rank hides them under compute; {hsdp}")
    elif role in ("dp_replicate", "expert_dp"):
        over = f"dp_replicate={replicate}" if role == "dp_replicate" else role
        text = (f"the gradient all-reduce over {over} takes {share} of the step: a larger batch per rank, or"
                " accumulate_grad_batches=2 to all-reduce once every 2 batches")
    elif role == "cp":
        text = (f"cp={dims['cp']} ring attention takes {share} of the step: {_smaller('cp', dims['cp'])} or longer"
                " sequences per rank, so attention's compute hides the ring's transfers")
    elif role == "ep":
        text = (f"ep={dims['ep']} MoE all-to-all takes {share} of the step: {_smaller('ep', dims['ep'])}, and ep"
                " inside a node")
    elif role == "pp":
        text = (f"pp={dims['pp']} point-to-point sends between stages take {share} of the step: neighbouring stages"
                f" on one node, or {_smaller('pp', dims['pp'])}")
    else:
        text = (f"{role} communication takes {share} of the step: find its collectives in the collective record"
                " (metrics with sync_dist, barriers, logging) and run them less often")
    return tuple(across + [text])


def bubble(pp: int, microbatches: int, stages_per_rank: int) -> float:
    """The idle fraction of a pipeline step with ``microbatches`` microbatches and ``stages_per_rank`` stages
    per rank (GPipe and 1F1B run one): (pp-1)/(v*m+pp-1) (Narayanan et al., 2021)."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def _bubble_advice(share: str, context: WindowContext) -> tuple[str, ...]:
    """More microbatches (the fewest multiple of the current count under `BUBBLE_TARGET`), then an interleaved
    schedule for a single-stage one."""
    pp, schedule, v = context.dims.get("pp", 1), context.pp_schedule, context.pp_stages_per_rank or 1
    now = context.pp_microbatches
    if pp < 2:
        return (f"pipeline idle {share} of the step, but the layout has pp={pp}: check the record's dims",)
    if now is None:
        more = next(m for m in itertools.count(1) if bubble(pp, m, v) <= BUBBLE_TARGET)
        advice = [f"pipeline idle {share} of the step at pp={pp}, the microbatch count unknown: the bubble is"
                  f" (pp-1)/(v*m+pp-1) for m microbatches and v stages per rank; pp_microbatches={more} gives"
                  f" ~{percent(bubble(pp, more, v))}"]
    else:
        more = next((k * now for k in (2, 4, 8, 16) if bubble(pp, k * now, v) <= BUBBLE_TARGET), 16 * now)
        advice = [f"bubble {share} with {now} microbatches at pp={pp} ({schedule or 'schedule unknown'}):"
                  f" pp_microbatches={more} gives ~{percent(bubble(pp, more, v))}"
                  f" (the batch per step must split into {more} microbatches)"]
    if v == 1:
        at = now or more
        advice.append(f"or an interleaved schedule: pp_schedule='interleaved_1f1b' with pp_stages_per_rank=2 gives"
                      f" ~{percent(bubble(pp, at, 2))} at {at} microbatches")
    return tuple(advice)


__all__ = ["BUBBLE_TARGET", "Straggler", "Window", "advice", "bubble", "count", "mean", "percent", "secs"]
