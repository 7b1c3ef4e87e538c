"""Bytes one rank moves per optimizer step on each mesh dim: ``comm_per_step(layout, shape, workload, rank)``.

Counted as a ring algorithm moves them, per rank: all-reduce 2B(n-1)/n, all-gather and reduce-scatter B(n-1)/n
(B = the full tensor, n = the group's ranks); point-to-point: the bytes a rank sends; all-to-all: the rows it
sends to the others. ``benchmarks/comm_volume.py`` checks each dim against the collectives a run issues.

- fsdp (``dp_shard x cp``): all-gathers of the parameters as TP leaves them on this rank (in ``param_dtype``),
  a reduce-scatter of their gradients (in ``reduce_dtype``). Per micro-step (accumulation), zero 3 gathers in
  forward and again in backward, zero 2 once; zero 1 gathers and reduces once per optimizer step. Under pp the
  pipeline reduces once per batch for all its microbatches and zero 2 gathers once; zero 3 frees the blocks
  after every microbatch's forward, so up to 2 x microbatches gathers (an upper bound).
- dp_replicate (HSDP): one all-reduce of the gradient shard per reduce-scatter.
- expert_dp: FSDP over the ranks holding the same experts, by the fsdp rule on this rank's expert shards.
- tp: per block one activation all-reduce forward and one backward per row-parallel layer of the plan (attention
  output and a dense MLP's down projection: two each; an MoE block without a dense or shared MLP: one), the embedding's, the
  head's input-gradient all-reduce and the all-gather of its logits (none under loss_parallel). Under sequence
  parallel each all-reduce becomes an all-gather and a reduce-scatter: the same ring bytes. Experts split over tp
  (expert tensor parallelism) add per MoE block two all-reduces of the routed rows (tokens x top_k x ``hidden``):
  their partial outputs forward, their input's gradient backward.
- pp: per micro-step the activations of all microbatches forward to the next stage and their gradients back,
  for each neighbour stage on another pp rank; a weight tied between the first and last stage adds one
  all-reduce of its gradient per step.
- cp (ring attention): per block 2 x (cp-1) x the local K and V bytes (K/V round the ring forward, and again in
  backward, which recomputes instead of keeping them) and cp x their gradients' bytes in fp32 (each block's dK/dV
  travels with it and takes one more hop home).
- ep: per MoE block 4 all-to-alls (dispatch and combine, forward and backward) of tokens x top_k rows of
  ``hidden`` elements, (ep-1)/ep of them sent off-rank (routing spread evenly), per microbatch under pp; before
  them an all-to-all and an all-reduce of the tokens per expert.

Tokens per rank = batch x seq_len / cp; activations are ``workload.activation_bytes`` per element.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_nd.cost.model_state import DTYPE_BYTES
from lightning_nd.cost.shape import ModelShape, Workload
from lightning_nd.layout.record import Layout, RankHolding

COMM_DIMS = ("fsdp", "dp_replicate", "tp", "pp", "cp", "ep", "expert_dp")


@dataclass(frozen=True)
class Calls:
    """``count`` calls of one collective per optimizer step, each on a buffer of ``buffer_bytes`` (the whole tensor
    of an all-reduce, the gathered output of an all-gather, the input of a reduce-scatter, a rank's input to an
    all-to-all, a message): how a measured profile prices them, latency + buffer / bandwidth each."""

    kind: str
    count: int
    buffer_bytes: int


@dataclass(frozen=True)
class DimTraffic:
    """What one rank moves per optimizer step over one mesh dim."""

    dim: str
    """The mesh role: fsdp, dp_replicate, tp, pp, cp, ep or expert_dp."""
    bytes: int
    """Ring bytes per rank (point-to-point and all-to-all: the bytes it sends)."""
    group_size: int
    what: str
    """The collectives, in words."""
    calls: tuple[Calls, ...] = ()
    """The same traffic as calls: FSDP's per unit (this rank's blocks and the root), the rest as listed above."""


def comm_per_step(layout: Layout, shape: ModelShape, workload: Workload, rank: int = 0) -> dict[str, DimTraffic]:
    """Bytes ``rank`` moves per optimizer step on each mesh dim whose group has more than one rank."""
    run = _Run(layout, shape, workload, layout.rank(rank))
    traffic = {}
    for dim in COMM_DIMS:
        size = _group_size(layout, dim, rank) if dim in layout.roles else 1
        if size > 1:
            moved, what, calls = PRICES[dim](run, size)
            traffic[dim] = DimTraffic(dim, moved, size, what, tuple(call for call in calls if call.count))
    return traffic


def _group_size(layout: Layout, role: str, rank: int) -> int:
    return len(next(group for group in layout.roles[role] if rank in group))


class _Run:
    """What every dim's price reads: this rank's stages and shards, the step's tokens and options."""

    def __init__(self, layout: Layout, shape: ModelShape, workload: Workload, holding: RankHolding) -> None:
        self.layout, self.shape, self.holding = layout, shape, holding
        self.micro_steps = workload.accumulation
        self.tokens = workload.batch * workload.seq_len // layout.dims["cp"]
        self.activation_bytes = workload.activation_bytes
        mine = held_blocks(layout, holding.stages)
        self.has_embedding, self.has_head = held_ends(layout, holding.stages)
        self.blocks = len(mine)
        self.moe_blocks = moe_blocks_held(shape, mine)
        """This rank's blocks that hold experts."""
        self.gathers, self.reduces = _fsdp_passes(layout.options.zero_stage, layout.dims["pp"],
                                                  layout.options.pp_microbatches, self.micro_steps)

    def full_bytes(self, role: str, size: int, dtype: str | None) -> int:
        """Bytes of this rank's shards over ``role`` made whole (FSDP's padded shards x ``size``), in ``dtype``
        (None: each parameter's own)."""
        total = 0
        for shard in self.holding.params:
            if any(token.startswith(f"{role}:") for token in shard.placement.split()):
                own = DTYPE_BYTES.get(shard.dtype, 4)
                total += shard.padded_bytes // own * size * (DTYPE_BYTES.get(dtype, own) if dtype else own)
        return total


def held_blocks(layout: Layout, stages: Sequence[int]) -> Sequence[int]:
    """The indices of the blocks the pipeline ``stages`` hold (every block without a pipeline)."""
    pipeline = layout.pipeline
    if pipeline is None:
        return range(len(layout.blocks))
    units = {unit for stage in stages for unit in pipeline.split.stages[stage]}
    return [index for index, name in enumerate(pipeline.split.blocks) if name in units]


def held_ends(layout: Layout, stages: Sequence[int]) -> tuple[bool, bool]:
    """Whether the pipeline ``stages`` hold the first stage (the embedding) and the last (the head); both without a
    pipeline."""
    pipeline = layout.pipeline
    return pipeline is None or 0 in stages, pipeline is None or pipeline.num_stages - 1 in stages


def moe_blocks_held(shape: ModelShape, held: Sequence[int]) -> int:
    """How many of the ``held`` blocks hold experts (all of them when the shape does not say which)."""
    if not shape.experts:
        return 0
    moe = held if shape.moe_blocks is None else shape.moe_blocks
    return sum(index in moe for index in held)


def _fsdp_passes(zero_stage: int, pp: int, microbatches: int, micro_steps: int) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of every parameter per optimizer step."""
    if pp > 1:
        return (2 * microbatches if zero_stage == 3 else 1) * micro_steps, micro_steps
    if zero_stage == 1:
        return 1, 1
    return (2 if zero_stage == 3 else 1) * micro_steps, micro_steps


Priced = tuple[int, str, list[Calls]]
"""Ring bytes, the collectives in words, and as calls."""


def _sharded(run: _Run, size: int, role: str) -> Priced:
    options = run.layout.options
    gathered = run.full_bytes(role, size, options.param_dtype)
    reduced = run.full_bytes(role, size, options.reduce_dtype)
    moved = (run.gathers * gathered + run.reduces * reduced) * (size - 1) // size
    units = run.blocks + 1
    calls = [Calls("all_gather", run.gathers * units, gathered // units),
             Calls("reduce_scatter", run.reduces * units, reduced // units)]
    return moved, f"all-gather params x{run.gathers} + reduce-scatter grads x{run.reduces}", calls


def _fsdp(run: _Run, size: int) -> Priced:
    return _sharded(run, size, "fsdp")


def _expert_dp(run: _Run, size: int) -> Priced:
    moved, what, calls = _sharded(run, size, "expert_dp")
    return moved, f"experts: {what}", calls


def _dp_replicate(run: _Run, size: int) -> Priced:
    shard = run.full_bytes("fsdp", 1, run.layout.options.reduce_dtype)
    units = run.blocks + 1
    return (run.reduces * 2 * shard * (size - 1) // size, f"all-reduce grad shards x{run.reduces}",
            [Calls("all_reduce", run.reduces * units, shard // units)])


def _tp(run: _Run, size: int) -> Priced:
    options, shape = run.layout.options, run.shape
    activation = run.tokens * shape.hidden * run.activation_bytes
    all_reduces = 2 * _rowwise_per_block(run.layout) * run.blocks + run.has_embedding + run.has_head
    gathers_logits = run.has_head and not options.loss_parallel
    logits = run.tokens * shape.vocab * run.activation_bytes if gathers_logits else 0
    moved = run.micro_steps * (2 * all_reduces * activation + logits) * (size - 1) // size
    kind = "all-gather + reduce-scatter" if options.sequence_parallel else "all-reduce"
    what = f"{kind} activations x{all_reduces} per micro-step" + (" + all-gather logits" if logits else "")
    kinds = ("all_gather", "reduce_scatter") if options.sequence_parallel else ("all_reduce",)
    calls = [Calls(name, run.micro_steps * all_reduces, activation) for name in kinds]
    calls.append(Calls("all_gather", run.micro_steps if logits else 0, logits))
    if run.layout.applies("expert_tensor_parallel") and run.moe_blocks:
        rows = run.tokens * shape.top_k * shape.hidden * run.activation_bytes  # what the experts get, routed
        moved += run.micro_steps * run.moe_blocks * 2 * 2 * rows * (size - 1) // size
        what += f" + all-reduce routed tokens x{2 * run.moe_blocks} (experts split over tp)"
        calls.append(Calls("all_reduce", run.micro_steps * run.moe_blocks * 2, rows))
    return moved, what, calls


def _rowwise_per_block(layout: Layout) -> int:
    """Row-parallel layers per block in the tp plan (the attention output, a dense or shared MLP's down
    projection), each one all-reduce forward and its colwise partners' one backward; 2 when the plan names none
    inside a block (an explicit style object the names do not show)."""
    blocks = tuple(f"{block}." for block in layout.blocks)
    rowwise = sum(1 for entry in layout.tp if entry.module.startswith(blocks)
                  and (entry.style.startswith("rowwise") or entry.style.endswith("RowwiseParallel")))
    return round(rowwise / len(layout.blocks)) if rowwise and layout.blocks else 2


def _pp(run: _Run, size: int) -> Priced:
    pipeline, stages = run.layout.pipeline, run.holding.stages
    assert pipeline is not None
    owner = {stage: pp_rank for pp_rank, owned in enumerate(pipeline.ranks) for stage in owned}
    sends = sum((stage + 1 < pipeline.num_stages and owner[stage + 1] != owner[stage])
                + (stage > 0 and owner[stage - 1] != owner[stage]) for stage in stages)
    moved = run.micro_steps * sends * run.tokens * run.shape.hidden * run.activation_bytes
    what = f"send activations or their grads to another stage x{sends} per micro-step"
    microbatches = run.layout.options.pp_microbatches
    calls = [Calls("send_recv", 2 * run.micro_steps * sends * microbatches,  # the activation, then its gradient
                   run.tokens * run.shape.hidden * run.activation_bytes // microbatches)]
    last = pipeline.num_stages - 1
    if owner[0] != owner[last] and (0 in stages or last in stages):
        names = {f"{pipeline.attribute}.{name}" for pair in pipeline.split.tied for name in pair}
        tied = sum(shard.bytes for shard in run.holding.params if shard.name in names)
        if tied:  # an all-reduce over the pair of ranks holding the two copies: 2B(2-1)/2
            moved, what = moved + tied, what + " + all-reduce tied weights' grads"
            calls.append(Calls("all_reduce", 1, tied))
    return moved, what, calls


def _cp(run: _Run, size: int) -> Priced:
    tp = run.layout.dims["tp"]
    elements = 2 * run.tokens * run.shape.kv_dim // tp
    grad_bytes = max(run.activation_bytes, 4)  # dK/dV accumulate and travel in fp32 (fp64 for fp64)
    moved = run.micro_steps * run.blocks * elements * (2 * (size - 1) * run.activation_bytes + size * grad_bytes)
    hops = run.micro_steps * run.blocks
    calls = [Calls("send_recv", hops * 2 * (size - 1), elements * run.activation_bytes),
             Calls("send_recv", hops * size, elements * grad_bytes)]
    return (moved, "ring attention: K/V round the ring forward and again backward, their grads following them home",
            calls)


def _ep(run: _Run, size: int) -> Priced:
    shape, options = run.shape, run.layout.options
    moe_blocks = run.moe_blocks
    rows = run.tokens * shape.top_k * shape.hidden * run.activation_bytes
    moved = run.micro_steps * moe_blocks * 4 * rows * (size - 1) // size
    # Each microbatch of a pipeline dispatches its own tokens; before them, the int64 tokens per expert each rank
    # routes are exchanged (all-to-all) and summed over the group (all-reduce: the load the auxiliary loss reads).
    microbatches = options.pp_microbatches if run.layout.dims["pp"] > 1 else 1
    passes = run.micro_steps * microbatches * moe_blocks
    counts = shape.experts * 8
    return (moved, f"all-to-all tokens x{4 * moe_blocks} per micro-step (dispatch + combine, forward + backward)",
            [Calls("all_to_all", passes * 4, rows // microbatches), Calls("all_to_all", passes, counts),
             Calls("all_reduce", passes, counts)])


PRICES = {"fsdp": _fsdp, "dp_replicate": _dp_replicate, "tp": _tp, "pp": _pp, "cp": _cp, "ep": _ep,
          "expert_dp": _expert_dp}
