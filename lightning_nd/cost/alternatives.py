"""The changes that lower a run's memory, each priced by the cost model: the advice on an out-of-memory error
and the pre-flight's "this fits instead".

`memory_changes(layout, workload)` lists what can change at the same world size: recompute activations,
shard more (zero 3, HSDP to FSDP), split the model more (tp, pp, cp taken from dp_shard), sequence
parallelism, fewer microbatches in flight (gpipe to 1F1B), or a smaller micro-batch with more accumulation (the
same global batch). A change of dims needs the model to plan (`Change.sizes`); the others are options of the
same Layout. `price` gives each the expected peak of its highest rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_nd.cost.memory import RankMemory, peak_rank
from lightning_nd.cost.shape import ModelShape, Workload
from lightning_nd.layout.record import Layout

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


@dataclass(frozen=True)
class Change:
    action: str
    """What to write, e.g. ``NDParallel(activation_checkpointing='full')``."""
    options: dict[str, Any] = field(default_factory=dict)
    sizes: dict[str, int] | None = None
    """New dim sizes (None: the same dims)."""
    batch: int | None = None
    """A new micro-batch (samples per forward), with accumulation raised to keep the global batch."""
    detail: str = ""


def memory_changes(layout: Layout, workload: Workload) -> list[Change]:
    options, dims = layout.options, layout.dims
    sizes = {name: dims[name] for name in DIMS}
    changes = []
    order = ("none", "selective", "full")
    for mode in order[order.index(options.activation_checkpointing) + 1:]:
        changes.append(Change(f"NDParallel(activation_checkpointing={mode!r})", {"activation_checkpointing": mode},
                              detail="recompute activations in backward: about a third more compute" if mode == "full"
                              else "recompute all but matmul and attention outputs"))
    sharded = any(t.technique in ("fsdp", "hsdp") for t in layout.techniques)
    if sharded and options.zero_stage < 3 and dims["pp"] == 1:
        changes.append(Change("NDParallel(zero_stage=3)", {"zero_stage": 3},
                              detail="free gathered parameters after each block's forward: one more all-gather"))
    if dims["dp_replicate"] > 1:
        changes.append(Change(f"NDParallel(dp_replicate=1, dp_shard={dims['dp_replicate'] * dims['dp_shard']})",
                              sizes={**sizes, "dp_replicate": 1, "dp_shard": dims["dp_replicate"] * dims["dp_shard"]},
                              detail="shard over every data-parallel rank instead of replicating"))
    if dims["dp_shard"] % 2 == 0:
        for dim, what in (("tp", "split every weight matrix and its activations"),
                          ("pp", "split the layers into more stages"), ("cp", "split the sequence")):
            moved = {**sizes, dim: dims[dim] * 2, "dp_shard": dims["dp_shard"] // 2}
            changes.append(Change(f"NDParallel({dim}={moved[dim]}, dp_shard={moved['dp_shard']})", sizes=moved,
                                  detail=f"{what}; the batch ranks halve (twice the accumulation for the same batch)"))
    if dims["tp"] > 1 and not options.sequence_parallel:
        changes.append(Change("NDParallel(sequence_parallel=True)", {"sequence_parallel": True},
                              detail="shard the residual stream's activations over tp too"))
    if dims["pp"] > 1 and options.pp_schedule == "gpipe":
        changes.append(Change("NDParallel(pp_schedule='1f1b')", {"pp_schedule": "1f1b"},
                              detail="keep at most pp microbatches in flight, not all of them"))
    if workload.batch > 1 and workload.batch % 2 == 0:
        changes.append(Change(f"a micro-batch of {workload.batch // 2} with accumulate_grad_batches="
                              f"{workload.accumulation * 2}", batch=workload.batch // 2,
                              detail="half the activations per forward, the same global batch"))
    return changes


def price(layout: Layout, changes: list[Change], shape: ModelShape, workload: Workload,
          plan: Callable[[dict[str, int], dict[str, Any]], Layout] | None, *, optimizer: str = "adamw"
          ) -> list[tuple[Change, RankMemory, Workload]]:
    """Each change's expected highest peak, and the step it makes (the same global batch); a dims change is
    planned by ``plan(sizes, options)`` (skipped without one, or when the layout is invalid for the model)."""
    priced = []
    for change in changes:
        trial, trial_workload = layout, workload
        if change.sizes is not None:
            if plan is None:
                continue
            try:
                trial = plan(change.sizes, change.options)
            except (ValueError, TypeError):
                continue
            trial_workload = _rebatched(workload, layout, trial)
        elif change.options:
            trial = replace(layout, options=replace(layout.options, **change.options))
        if change.batch is not None:
            trial_workload = replace(workload, batch=change.batch, accumulation=workload.accumulation * 2)
        if not runnable(trial, trial_workload):
            continue
        priced.append((change, peak_rank(trial, shape, trial_workload, optimizer=optimizer), trial_workload))
    return priced


def runnable(layout: Layout, workload: Workload) -> bool:
    """Whether a batch of this shape can run under the layout: the microbatches divide it (pp), the sequence
    splits into 2 x cp chunks (cp) and over tp (sequence parallelism)."""
    dims, options = layout.dims, layout.options
    if dims["pp"] > 1 and workload.batch % options.pp_microbatches:
        return False
    if dims["cp"] > 1 and workload.seq_len % (2 * dims["cp"]):
        return False
    return not (options.sequence_parallel and workload.seq_len // dims["cp"] % dims["tp"])


def _rebatched(workload: Workload, before: Layout, after: Layout) -> Workload:
    """The same global batch on the new batch ranks: each sees more samples, over more accumulation steps."""
    ranks_before = before.dims["dp_replicate"] * before.dims["dp_shard"]
    ranks_after = after.dims["dp_replicate"] * after.dims["dp_shard"]
    factor = max(1, ranks_before // ranks_after)
    return replace(workload, accumulation=workload.accumulation * factor)
