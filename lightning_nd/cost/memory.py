"""Expected memory per rank for one training step: model state, activations, and the peak.

`rank_memory(layout, shape, workload, rank)` prices what ``rank`` holds (`model_state.py`) and keeps for
backward (`activations.py`) and returns the peak of the four moments a step's memory can top out at:

- the forward's end: parameters, optimizer state, the previous step's gradients (Lightning sets them to None
  after the forward, before backward), FSDP's gathered parameters, and every activation in flight;
- backward's start on the stage with the loss: the same without gradients, plus two fp32 [tokens, vocab]
  buffers (the gradients of the log-probabilities and of the logits);
- inside a block's backward: the blocks' activations, that block recomputed (full recomputation), the
  gradients flowing through it, and FSDP's unsharded gradients of one unit with the reduce-scatter's copy
  (under pp: the stage's, accumulated over the microbatches);
- the optimizer step: parameters, gradients, optimizer state and the step's temporaries (torch's foreach
  AdamW makes one list of the parameters' size, the denominator).

Microbatches in flight under pp follow the schedules: gpipe keeps all m, 1F1B on pp rank r keeps p - r,
interleaved (and, as an approximation, the other multi-stage schedules) keeps (v - 1) p + 2 (p - 1 - r) + 1
chunks of 1/v of the rank's blocks, looped BFS all m v.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, cast

from lightning_nd.cost.activations import block_backward_bytes, block_bytes, head_bytes, logits_bytes
from lightning_nd.cost.model_state import block_of, model_state
from lightning_nd.cost.shape import ModelShape, Workload
from lightning_nd.layout.record import Layout

FOREACH_TEMPORARIES = {"adamw": 1, "adam": 1, "sgd": 0, "sgd_momentum": 0, "adagrad": 1, "rmsprop": 1}
"""Parameter-sized lists torch's foreach step allocates at once (Adam/AdamW/Adagrad/RMSprop: sqrt of the
second moment; SGD updates in place)."""


@dataclass(frozen=True)
class RankMemory:
    """Expected bytes on one rank (``peak_bytes``: the largest of the step's four moments, `peak_moment`, in the
    device's memory: under cpu_offload the sharded state is in host memory and not part of it)."""

    rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    """Everything kept for backward at the forward's end (all microbatches in flight under pp)."""
    temporaries_bytes: int
    """What the peak moment adds beyond the four above: FSDP's gathered parameters, the loss's gradient
    buffers, or the optimizer's temporaries."""
    peak_bytes: int
    peak_moment: str
    """forward_end, backward_start, backward_block or optimizer_step."""
    microbatches_in_flight: int
    blocks: int

    def to_dict(self) -> dict:
        return asdict(self)


def tokens_per_microbatch(layout: Layout, workload: Workload) -> int:
    """Tokens one rank's blocks see in one forward: the micro-batch (pp splits the batch) x the local sequence."""
    microbatches = layout.options.pp_microbatches if layout.dims["pp"] > 1 else 1
    return max(1, workload.batch // microbatches) * (workload.seq_len // layout.dims["cp"])


def in_flight(layout: Layout, pp_rank: int) -> tuple[int, int]:
    """(chunks in flight on this pp rank, chunks its blocks make): activations of that many chunk-microbatches."""
    p, options = layout.dims["pp"], layout.options
    if p == 1:
        return 1, 1
    m, v, schedule = options.pp_microbatches, options.pp_stages_per_rank, options.pp_schedule
    if schedule == "gpipe":
        return m, 1
    if schedule == "1f1b":
        return min(m, p - pp_rank), 1
    if schedule == "looped_bfs":
        return m * v, v
    return min(m * v, (v - 1) * p + 2 * (p - 1 - pp_rank) + 1), v


def rank_memory(layout: Layout, shape: ModelShape, workload: Workload, rank: int, *,
                optimizer: str = "adamw") -> RankMemory:
    """The expected memory of ``rank`` in one training step of ``workload`` under ``layout``."""
    state = model_state(layout, rank, optimizer)
    holding, options, dims = layout.rank(rank), layout.options, layout.dims
    names = frozenset(layout.blocks)
    held_blocks = {block_of(p.name, names) for p in holding.params} - {None}
    blocks = len(held_blocks)
    moe = shape.moe_blocks
    dense = sum(layout.blocks.index(cast(str, name)) not in moe for name in held_blocks) if moe else 0
    chunks, chunks_per_stage = in_flight(layout, holding.coordinates["pp"])
    tokens, element = tokens_per_microbatch(layout, workload), workload.activation_bytes
    tp, recompute, pp = dims["tp"], options.activation_checkpointing, dims["pp"] > 1
    split: dict[str, Any] = {"tp": tp, "sequence_parallel": options.sequence_parallel, "cp": dims["cp"],
                             "ep": dims["ep"], "etp": layout.applies("expert_tensor_parallel")}
    per_block = block_bytes(shape, tokens, element, recompute=recompute, **split)
    if dense:  # DeepSeek's first blocks are dense: the mean over the blocks held
        dense_block = block_bytes(shape, tokens, element, recompute=recompute, moe=False, **split)
        per_block = (dense * dense_block + (blocks - dense) * per_block) // blocks
    block_activations = chunks * (blocks // chunks_per_stage) * per_block
    has_loss = layout.pipeline is None or layout.pipeline.num_stages - 1 in holding.stages
    loss_parallel = options.loss_parallel
    head = 0
    if has_loss:
        losses_in_flight = options.pp_microbatches if pp and options.pp_schedule == "gpipe" else 1
        head = losses_in_flight * head_bytes(shape, tokens, element, tp=tp, loss_parallel=loss_parallel)
    if pp and not has_loss:  # the schedule keeps each microbatch's stage output until its gradient comes back
        head = chunks * tokens * shape.hidden * element
    activations = block_activations + head
    # Under cpu_offload FSDP keeps the sharded parameters, gradients and optimizer state in host memory (the step
    # runs there too): the device holds only what is gathered, the activations and the temporaries.
    offloaded = bool(options.cpu_offload)
    base = 0 if offloaded else state.params_allocated_bytes + state.optimizer_bytes
    # Under pp, FSDP accumulates the stage's gradients unsharded over the microbatches (the schedule turns its
    # reduction off until the last; without FSDP they accumulate in place), and the previous step's gradients
    # are gone before the schedule runs.
    # Otherwise each unit's gradients are unsharded, then copied into the reduce-scatter's input, one unit at a time.
    unsharded_grads = (state.stage_grads_bytes or state.grads_bytes) if pp else state.unit_grads_bytes
    old_grads = 0 if pp or offloaded else state.grads_bytes
    # Under gradient accumulation the micro-steps after the first keep the gradients so far through backward
    # (zero 1: unsharded, every unit; `parallel/fsdp.py`).
    accumulated = 0
    if workload.accumulation > 1 and not pp:
        accumulated = state.stage_grads_bytes if options.zero_stage == 1 and state.stage_grads_bytes else old_grads
    kinds = (True, False) if dense else (True,)  # one block at a time is recomputed: the larger kind
    recomputed = max(block_bytes(shape, tokens, element, moe=moe, **split) for moe in kinds
                     ) if recompute == "full" and blocks else 0
    loss_grads = 2 * logits_bytes(shape, tokens, tp=tp, loss_parallel=loss_parallel) if has_loss else 0
    in_block = block_backward_bytes(shape, tokens, element, tp=tp) if blocks else 0
    held = {"forward_end": old_grads + activations, "backward_start": activations + accumulated,
            "backward_block": block_activations + accumulated, "optimizer_step": 0 if offloaded else state.grads_bytes}
    transient = {
        "forward_end": state.gathered_bytes,
        "backward_start": state.gathered_bytes + loss_grads + (unsharded_grads if pp else 0),
        "backward_block": state.gathered_bytes + recomputed + in_block + unsharded_grads,
        "optimizer_step": 0 if offloaded else FOREACH_TEMPORARIES[optimizer] * state.params_bytes,
    }
    moment = max(transient, key=lambda name: held[name] + transient[name])
    return RankMemory(rank, state.params_bytes, state.grads_bytes, state.optimizer_bytes, activations,
                      transient[moment], base + held[moment] + transient[moment], moment, chunks, blocks)


def rank_memories(layout: Layout, shape: ModelShape, workload: Workload, *,
                  optimizer: str = "adamw") -> tuple[RankMemory, ...]:
    """Every rank's `rank_memory`. Ranks whose pieces have the same names, sizes and placements at the same
    pipeline position cost the same (tp and FSDP peers, mostly): each is priced once."""
    priced: dict[tuple, RankMemory] = {}
    pieces: dict[int, tuple] = {}  # ranks of a planned Layout that hold the same pieces share one tuple of them
    ranks = []
    for holding in layout.ranks:
        if id(holding.params) not in pieces:
            pieces[id(holding.params)] = tuple((p.name, p.bytes, p.padded_bytes, p.placement) for p in holding.params)
        key = (holding.coordinates["pp"], pieces[id(holding.params)])
        if key not in priced:
            priced[key] = rank_memory(layout, shape, workload, holding.rank, optimizer=optimizer)
        memory = priced[key]
        ranks.append(memory if memory.rank == holding.rank else replace(memory, rank=holding.rank))
    return tuple(ranks)


def peak_rank(layout: Layout, shape: ModelShape, workload: Workload, *, optimizer: str = "adamw") -> RankMemory:
    """The rank with the highest expected peak (the first of equals)."""
    return max(rank_memories(layout, shape, workload, optimizer=optimizer), key=lambda memory: memory.peak_bytes)
