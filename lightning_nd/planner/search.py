"""The planner: every valid layout of a model on ``devices`` GPUs, costed and ranked.

`candidate_sizes` enumerates dim sizes the way they should be placed: tp, cp (and ep, borrowed from dp_shard x
cp) inside a node, pp and dp across; dp_shard over the rest, and HSDP (dp_shard inside a node, replicated
across nodes) where that differs. Each is planned with the very functions the run uses (an invalid one is
skipped, with the reason counted), then costed with the least recomputation that fits (none, then selective,
then full), tp with sequence parallelism unless ``options`` say otherwise, and with the longest sequence each
fits. Ranked: layouts that fit by estimated step time, then the rest by expected peak.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_nd.cost.hardware import Hardware
from lightning_nd.cost.layout_cost import LayoutCost, cost_layout
from lightning_nd.cost.memory import rank_memories
from lightning_nd.cost.op_count import OpCount
from lightning_nd.cost.profile import HostProfile
from lightning_nd.cost.shape import ModelShape, Workload
from lightning_nd.layout.record import Layout
from lightning_nd.mesh.dims import divisors

RECOMPUTE_ORDER = ("none", "selective", "full")


@dataclass(frozen=True)
class Batching:
    """The step the user wants: ``global_batch`` samples of ``seq_len`` tokens, ``micro_batch`` per forward."""

    seq_len: int
    global_batch: int
    micro_batch: int = 1
    precision: str = "bf16-mixed"


@dataclass
class Candidate:
    sizes: dict[str, int]
    options: dict[str, Any]
    layout: Layout
    workload: Workload
    cost: LayoutCost
    fits: bool
    why: str = ""
    longest_seq: int = 0
    """The longest sequence this layout, as costed (its recomputation), fits at the same micro-batch: the planner's
    answer to "how long can the context be" (0: its model state alone does not fit)."""


@dataclass
class Search:
    ranked: list[Candidate]
    skipped: Counter = field(default_factory=Counter)
    """Why enumerated sizes were left out: the first sentence of each error, counted."""


def candidate_sizes(devices: int, gpus_per_node: int, shape: ModelShape) -> list[dict[str, int]]:
    """Dim sizes worth planning: tp and cp (and ep) inside a node, every pp that leaves a block per stage."""
    found = []
    for tp in divisors(gpus_per_node):
        for cp in divisors(gpus_per_node // tp):
            if devices % (tp * cp):
                continue
            for pp in divisors(devices // (tp * cp)):
                if pp > shape.layers:
                    continue
                dp = devices // (tp * cp * pp)
                inside = max(d for d in divisors(dp) if d * tp * cp <= gpus_per_node)
                eps = [ep for ep in divisors(min(dp * cp, gpus_per_node // tp)) if shape.experts % ep == 0
                       and ep % cp == 0] if shape.experts else [1]
                for replicate in sorted({1, dp // inside}):
                    for ep in eps:
                        found.append({"pp": pp, "dp_replicate": replicate, "dp_shard": dp // replicate, "cp": cp,
                                      "tp": tp, "ep": ep})
    return found


def search(plan: Callable[[dict[str, int], dict[str, Any]], Layout], shape: ModelShape, devices: int,
           gpus_per_node: int, memory_bytes: int, batching: Batching, *, optimizer: str = "adamw",
           hardware: Hardware | None = None, options: dict[str, Any] | None = None,
           progress: Callable[[str], None] | None = None, profile: HostProfile | None = None,
           ops: OpCount | None = None) -> Search:
    """``plan(sizes, options) -> Layout`` is the dry run (raises ValueError on an invalid layout); ``profile``: a
    measured host that prices the step instead of ``hardware`` (``ops``: the model's counted operations)."""
    sizes_list = candidate_sizes(devices, gpus_per_node, shape)
    result = Search([])
    for index, sizes in enumerate(sizes_list):
        if progress is not None:
            progress(f"planning {index + 1}/{len(sizes_list)}: {describe_sizes(sizes)}")
        batch = batch_options(sizes, batching)
        if isinstance(batch, str):
            result.skipped[batch] += 1
            continue
        workload, extra = batch
        try:
            given = options or {}
            # The user's options stand, but for the microbatches the global batch sets; tp uses sequence
            # parallelism unless told otherwise (it shards the residual stream's activations too).
            layout = plan(sizes, {"sequence_parallel": sizes["tp"] > 1, **given, **extra,
                                  "pp_schedule": given.get("pp_schedule", extra.get("pp_schedule", "1f1b"))})
        except (ValueError, TypeError) as error:
            result.skipped[str(error).split(". ")[0]] += 1
            continue
        result.ranked.append(_least_recompute(layout, sizes, shape, workload, memory_bytes, optimizer, hardware,
                                              gpus_per_node, profile, ops))
    result.ranked.sort(key=lambda c: (not c.fits, c.cost.time.total_s if c.fits and c.cost.time else 0,
                                      c.cost.peak.peak_bytes))
    return result


def describe_sizes(sizes: dict[str, int]) -> str:
    """``tp=8,pp=4,dp_shard=2``: the sizes that are not 1 (dp_shard always), in the mesh's order."""
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
    return ",".join(f"{name}={sizes[name]}" for name in names if sizes.get(name, 1) > 1 or name == "dp_shard")


def batch_options(sizes: dict[str, int], batching: Batching) -> tuple[Workload, dict[str, Any]] | str:
    """The workload and pp options that make ``global_batch`` on these sizes, or why they cannot."""
    dp = sizes["dp_replicate"] * sizes["dp_shard"]
    if batching.global_batch % dp:
        return f"global batch {batching.global_batch} does not split over dp={dp}"
    per_rank = batching.global_batch // dp
    if per_rank % batching.micro_batch:
        return f"{per_rank} samples per batch rank do not split into micro-batches of {batching.micro_batch}"
    steps = per_rank // batching.micro_batch
    if sizes["cp"] > 1 and batching.seq_len % (2 * sizes["cp"]):
        return f"sequence {batching.seq_len} does not split into 2 x cp={sizes['cp']} chunks"
    if sizes["pp"] > 1:
        if steps < sizes["pp"]:
            return f"{steps} microbatches are fewer than pp={sizes['pp']} stages"
        return (Workload(batching.seq_len, per_rank, 1, batching.precision),
                {"pp_microbatches": steps, "pp_schedule": "1f1b"})
    return Workload(batching.seq_len, batching.micro_batch, steps, batching.precision), {}


def _least_recompute(layout: Layout, sizes: dict[str, int], shape: ModelShape, workload: Workload, memory_bytes: int,
                     optimizer: str, hardware: Hardware | None, gpus_per_node: int, profile: HostProfile | None = None,
                     ops: OpCount | None = None) -> Candidate:
    for mode in RECOMPUTE_ORDER:
        trial = replace(layout, options=replace(layout.options, activation_checkpointing=mode))
        cost = cost_layout(trial, shape, workload, optimizer=optimizer, hardware=hardware, gpus_per_node=gpus_per_node,
                           profile=profile, ops=ops)
        fits = cost.peak.peak_bytes <= memory_bytes
        if fits:
            break
    keys = (("zero_stage", "activation_checkpointing") + (("sequence_parallel",) if sizes["tp"] > 1 else ())
            + (("pp_schedule", "pp_microbatches") if sizes["pp"] > 1 else ()))
    options = {key: getattr(trial.options, key) for key in keys}
    longest = longest_sequence(trial, shape, workload, memory_bytes, optimizer)
    return Candidate(sizes, options, trial, workload, cost, fits, longest_seq=longest)


LONGEST_SEARCHED = 1 << 24  # 16M tokens: "at least this long" beyond


def longest_sequence(layout: Layout, shape: ModelShape, workload: Workload, memory_bytes: int,
                     optimizer: str = "adamw") -> int:
    """The longest sequence (a multiple of what cp and sequence parallelism split it into) whose expected peak on
    every rank stays within ``memory_bytes``, by bisection: the peak grows with the sequence."""
    dims = layout.dims
    step = math.lcm(2 * dims["cp"] if dims["cp"] > 1 else 1, dims["tp"] if layout.options.sequence_parallel else 1)

    def fits(seq: int) -> bool:
        trial = replace(workload, seq_len=seq)
        return max(m.peak_bytes for m in rank_memories(layout, shape, trial, optimizer=optimizer)) <= memory_bytes

    low, high = 0, max(step, workload.seq_len // step * step)  # low fits (0 trivially); find a high that does not
    while fits(high):
        low, high = high, high * 2
        if high > LONGEST_SEARCHED:
            return low
    while high - low > step:
        middle = (low + high) // 2 // step * step
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def print_progress(line: str) -> None:
    """One status line on stderr, rewritten in place."""
    sys.stderr.write(f"\r{line[:100]:100}")
    sys.stderr.flush()
