"""The planner's output: a ranked markdown table (one line per layout saying why it ranks there), the arithmetic
of the model state per rank under both accountings, and the same as JSON."""

from __future__ import annotations

from typing import Any

from lightning_nd.cost.memory import RankMemory
from lightning_nd.cost.model_state import DTYPE_BYTES, ZERO_PAPER_K
from lightning_nd.layout.describe import human_bytes
from lightning_nd.layout.record import Layout
from lightning_nd.planner.search import LONGEST_SEARCHED, Candidate, Search, describe_sizes

PAPER_STAGE = {1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}


def planner_markdown(result: Search, memory_bytes: int, *, params: int, top: int = 20) -> str:
    ranked = result.ranked
    lines = [f"| # | layout | recompute | params | grads | optimizer | activations | temporaries | peak / GPU | fits in"
             f" {human_bytes(memory_bytes)} | longest seq | heaviest comm / step | bubble | step (est.) | why |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for index, candidate in enumerate(ranked[:top], start=1):
        peak, time = candidate.cost.peak, candidate.cost.time
        lines.append(
            f"| {index} | `{describe_sizes(candidate.sizes)}` | {candidate.options['activation_checkpointing']} |"
            f" {human_bytes(peak.params_bytes)} | {human_bytes(peak.grads_bytes)} | {human_bytes(peak.optimizer_bytes)} |"
            f" {human_bytes(peak.activations_bytes)} | {human_bytes(peak.temporaries_bytes)} |"
            f" {human_bytes(peak.peak_bytes)} | {'yes' if candidate.fits else 'no'} | {_longest(candidate)} |"
            f" {_heaviest_comm(candidate)} | {f'{time.bubble_fraction:.1%}' if time else '-'} |"
            f" {f'{time.total_s:.2f} s' if time else '-'} | {why(candidate, ranked[0], memory_bytes)} |")
    shown = min(top, len(ranked))
    lines.append(f"\n{len(ranked)} layouts costed, {shown} shown; peak = the highest rank's expected peak;"
                 " longest seq = the longest sequence the layout fits with its recompute and micro-batch.")
    if result.skipped:
        lines.append("Left out: " + "; ".join(f"{reason} ({count})" for reason, count in result.skipped.most_common()))
    if ranked:
        lines += ["", "#1: " + model_state_arithmetic(ranked[0].layout, ranked[0].cost.peak, params)]
    return "\n".join(lines)


def _longest(candidate: Candidate) -> str:
    if candidate.longest_seq >= LONGEST_SEARCHED:
        return f">= {LONGEST_SEARCHED:,}"
    return f"{candidate.longest_seq:,}" if candidate.longest_seq else "none"


def why(candidate: Candidate, best: Candidate, memory_bytes: int) -> str:
    """One line: why this layout ranks where it does."""
    peak, time = candidate.cost.peak, candidate.cost.time
    if not candidate.fits:
        kinds = {"optimizer state": peak.optimizer_bytes, "activations": peak.activations_bytes,
                 "parameters": peak.params_bytes, "temporaries": peak.temporaries_bytes}
        largest = max(kinds, key=kinds.get)
        return (f"does not fit even with {candidate.options['activation_checkpointing']} recomputation:"
                f" {human_bytes(peak.peak_bytes - memory_bytes)} over, largest part {largest}")
    if candidate is best or time is None or best.cost.time is None:
        return "fastest layout that fits" if candidate is best else "fits"
    slower = time.total_s / best.cost.time.total_s - 1
    reasons = {"pipeline bubble": time.total_s * time.bubble_fraction - best.cost.time.total_s * best.cost.time.bubble_fraction,
               "exposed communication": time.exposed_comm_s - best.cost.time.exposed_comm_s,
               "compute (recomputation or less parallel work)": time.compute_s - best.cost.time.compute_s}
    main = max(reasons, key=reasons.get)
    return f"{slower:+.0%} step time vs #1, mostly {main}"


def _heaviest_comm(candidate: Candidate) -> str:
    time, comm = candidate.cost.time, candidate.cost.comm
    if not comm:
        return "none"
    dim = max(comm, key=lambda d: time.comm_s.get(d, 0) if time else comm[d].bytes)
    link = f" over {time.link[dim]}" if time and dim in time.link else ""
    return f"{dim} {human_bytes(comm[dim].bytes)}{link}"


def model_state_arithmetic(layout: Layout, peak: RankMemory, params: int) -> str:
    """Parameters, gradients and optimizer state of the peak rank, as FSDP2 holds them here and under the ZeRO
    paper's accounting, and why "parameters x 4 bytes / dp" is not the optimizer state per GPU."""
    dims = layout.dims
    model_split, fsdp = dims["tp"] * dims["pp"], dims["dp_shard"] * dims["cp"]
    share = params / model_split
    element = DTYPE_BYTES.get(layout.rank(peak.rank).params[0].dtype, 4)
    stage = layout.options.zero_stage
    paper = {1: 4 * share + ZERO_PAPER_K * share / fsdp, 2: 2 * share + (2 + ZERO_PAPER_K) * share / fsdp,
             3: (4 + ZERO_PAPER_K) * share / fsdp}[stage]
    dp = dims["dp_replicate"] * dims["dp_shard"]
    return "\n".join([
        f"Model state of rank {peak.rank} (`{describe_sizes(dims)}`, zero_stage={stage}):",
        f"- it holds 1/(tp x pp) = 1/{model_split} of the {params / 1e9:.2f}B parameters, {share / 1e9:.3f}B,"
        f" and FSDP shards those over dp_shard x cp = {fsdp}: {peak.params_bytes / element / 1e9:.3f}B on this rank;",
        f"- as FSDP2 holds them here: parameters {human_bytes(peak.params_bytes)} ({element} bytes each),"
        f" gradients {human_bytes(peak.grads_bytes)}, optimizer state {human_bytes(peak.optimizer_bytes)};",
        f"- under the ZeRO paper's accounting (2 + 2 + {ZERO_PAPER_K} bytes per parameter, {PAPER_STAGE[stage]} over"
        f" {fsdp}): {human_bytes(paper)} of model state, {human_bytes(ZERO_PAPER_K * share / fsdp)} of it optimizer"
        " state;",
        f"- not \"{params / 1e9:.0f}B x 4 bytes / {dp} = {human_bytes(params * 4 / dp)} of optimizer state per GPU\":"
        f" that divides the whole model by dp, but each GPU holds only its 1/{model_split} tp x pp share, itself"
        f" sharded {fsdp} ways.",
    ])


def planner_json(result: Search, memory_bytes: int) -> dict[str, Any]:
    return {
        "memory_bytes": memory_bytes,
        "layouts": [{"rank": index, "sizes": c.sizes, "options": c.options, "fits": c.fits,
                     "longest_seq": c.longest_seq, "why": why(c, result.ranked[0], memory_bytes),
                     "cost": c.cost.to_dict()}
                    for index, c in enumerate(result.ranked, start=1)],
        "skipped": dict(result.skipped),
    }
