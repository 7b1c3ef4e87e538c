"""How long one optimizer step takes on the host a `HostProfile` measured (``plan --calibrate``):
``profiled_step_time(layout, shape, workload, profile, ops)``. Where `step_time.py` divides FLOPs by a datasheet
peak, this prices what a small or medium model's eager step on that host is made of, per rank:

- **Matmuls** at this rank's shapes (tp splits the heads and the MLP's inner size, cp the tokens, pp the blocks):
  each block's projections, the head over the vocabulary, an MoE block's routed rows through its local experts;
  each forward matmul and its two backward ones priced by the profile's throughput at that size.
- **Attention** as the profile measured it (`HostProfile.attention_seconds`: far from matmul speed for small heads
  on CPU), once per ring hop under cp; where it was not measured, its scores and weighted values as matmuls.
- **Memory-bound operations**: the bytes the model's own operations other than matmuls move per token, counted on
  the meta device or a small model's CPU copy (`op_count.py`), over the profile's memory throughput; where they could
  not be counted, per block and token the norms, residual adds, rotary embedding, softmax over the sequence and the
  MLP's activation, read and written once forward and twice backward. The optimizer's update (AdamW: parameter,
  gradient, two moments, read and written).
- **Eager overhead**: the operations one micro-batch's forward and backward run, counted on the model itself
  (`op_count.py`; under ep a rank's share of those inside the experts; `OPS_PER_BLOCK` and `OPS_PER_EXPERT` when
  they could not be counted), x the profile's time per operation, with the operations ring attention adds under cp
  (`RING_OPS_PER_BLOCK`).
- **Frameworks** (where the profile measured them, on CPU): each FSDP unit's hooks and collectives per forward and
  backward pass (a unit over tp's DTensors as measured on a 2-D mesh, about twice a plain one's on the 2-core host;
  under ep also each block's experts, a unit over the ranks holding the same experts, priced as such a 2-D unit
  since the experts are DTensors over ep); each
  tensor-parallel column-wise / row-wise pair as measured (a sequence-parallel block's, with its norm and residual
  add, under sequence parallelism), and the DTensor operations of the column-wise layers beyond one per pair (a
  transpose, matmul and bias add each, with their backward); AdamW's update per parameter tensor (a DTensor one
  where FSDP or tp made it one); a pipeline's schedule and exchanges per microbatch.
- **Collectives**: every call `comm.py` lists and the logged loss's average over the batch ranks, latency +
  buffer / bandwidth at its group size, the latency taken as a call's inside a step after the rank's work between
  two calls (its compute over its calls) where the profile measured it (`CollectiveFit.in_step`). FSDP's, tp's and
  pp's latency is in the unit's, the pair's or the microbatch's measured time: their calls add their bytes and how
  much longer a call waits after that work than after none. Nothing overlaps: the profile does not measure how much
  a collective hides behind compute on this host.
- **Pipeline**: the stage's work over all microbatches / (1 - bubble), as `step_time.py` (on a host whose ranks
  outnumber its cores, below, only the idle share of its fill and drain).
- **A host whose ranks outnumber its cores** (the profile's ``processes`` over its ``cores``: 4 ranks on 2 CPU
  cores): every time above is one rank's while all of them run, so the sum is the rank's share of the cores' work.
  The step is that work over the share of the cores the ranks keep busy (`HostProfile.busy_share` at the rank's
  work between two collective calls: a rank waiting for one gives its core up, and while the others wait too the
  core idles), and a pipeline's bubble costs only what the cores idle while it fills and drains
  (`shared_core_fill`): a stage waiting for its neighbours lends its core to the stages that work, where there are
  enough of them.
"""

from __future__ import annotations

from lightning_nd.cost.comm import comm_per_step, held_blocks, held_ends, moe_blocks_held
from lightning_nd.cost.op_count import OpCount
from lightning_nd.cost.profile import FrameworkPoint, HostProfile
from lightning_nd.cost.shape import ModelShape, Workload
from lightning_nd.cost.step_time import RECOMPUTE_FACTOR, StepTime, flops_per_token
from lightning_nd.layout.record import Layout
from lightning_nd.pipeline_parallel.schedules import chunks_per_rank, theoretical_bubble

OPS_PER_BLOCK = 250
"""Forward and backward operations of a block whose count could not be read (a data-dependent MoE dispatch in a
model too large to count on a CPU copy, `op_count.CPU_COUNT_PARAMS`): the
middle of the dense blocks counted (the example GPT's 171, LitGPT Llama 3's 254, HF Mistral's 267, the example
Llama's 304)."""
OPS_PER_EXPERT = 30
"""More per local expert of such a block: an expert's three projections and activation, forward and backward."""
DTENSOR_OPS_PER_LINEAR = 3
"""DTensor operations of one tensor-parallel linear layer's forward (the weight's transpose, the matmul, the bias add;
`F.linear` decomposes so on a DTensor), each priced with its backward by the profile's ``dtensor_op_s``."""
RING_OPS_PER_BLOCK, RING_OPS_PER_HOP = 180, 80
"""Operations ring attention (`context_parallel/`) adds to a block's forward and backward beyond the attention the
model's count holds, and more per hop round a ring of cp ranks: counted on the example Llama's step (1,311 at
dp_shard=4, 2,347 at dp_shard=2 x cp=2, 2,991 at cp=4, over 4 blocks)."""
LOGGED_BYTES = 4
"""The logged loss: one float32 scalar."""
ONCE_PER_STEP = ("pp", "loss")
"""Collectives outside the pipeline's stage work: its exchanges (priced per call) and the logged loss's average."""
OPTIMIZER_PASSES = 8
"""AdamW's update reads and writes the parameter and two moments and reads the gradient."""


def profiled_step_time(layout: Layout, shape: ModelShape, workload: Workload, profile: HostProfile,
                       ops: OpCount | None, dtype: str = "float32") -> StepTime:
    """Rank 0's step of ``layout`` on the profile's host; ``ops``: the model's counted operations, if any."""
    dims, options = layout.dims, layout.options
    tp, cp, pp = dims["tp"], dims["cp"], dims["pp"]
    holding = layout.rank(0)
    held = held_blocks(layout, holding.stages)
    blocks = len(held)
    first, last = held_ends(layout, holding.stages)
    micro_steps, batch = workload.accumulation, workload.batch
    tokens = batch * workload.seq_len // cp
    recompute = RECOMPUTE_FACTOR[options.activation_checkpointing]
    seq = workload.seq_len // cp
    attention = profile.attention_seconds(batch * max(1, shape.heads // tp), seq, shape.head_dim)
    matmul = sum(profile.matmul_seconds(m, n, k, dtype) * count for m, n, k, count in
                 _block_matmuls(shape, tokens, batch, seq, tp, dims.get("ep", 1), attention is None))
    matmul = (matmul + (attention or 0.0) * cp) * blocks * recompute  # under cp, a block of keys per ring hop
    if last:
        matmul += 3 * profile.matmul_seconds(tokens, shape.vocab // (tp if options.loss_parallel else 1), shape.hidden,
                                             dtype)
    if ops is not None and ops.bytes_per_token:  # counted at float32, scaled to the activations' dtype
        scale = tokens * workload.activation_bytes / 4 / tp
        memory = profile.memory_seconds(scale * (ops.bytes_per_token[0] * blocks
                                                 + ops.outside_bytes_per_token * (first or last)))
    else:
        elementwise = _elementwise_bytes(shape, seq, tp) * tokens * workload.activation_bytes
        memory = profile.memory_seconds(elementwise * 3 * blocks)
    ep = dims.get("ep", 1)
    if ops is not None and ops.per_block:  # expert parallelism runs this rank's experts only
        counted = ops.per_block[0] - (ops.expert_ops[0] * (ep - 1) // ep if ops.expert_ops else 0)
    else:
        counted = OPS_PER_BLOCK + OPS_PER_EXPERT * shape.experts // ep
    outside = (ops.outside if ops is not None else 2 * OPS_PER_BLOCK) * (first or last)
    microbatches = options.pp_microbatches if pp > 1 else 1
    ring = RING_OPS_PER_BLOCK + RING_OPS_PER_HOP * (cp - 1) if cp > 1 else 0
    overhead = profile.op_overhead_s * ((counted + ring) * blocks + outside) * microbatches
    fsdp = "fsdp" in {t.technique for t in layout.techniques}
    framework = profile.framework_at(dims["dp_shard"] * cp)
    tp_framework = profile.framework_at(tp) if tp > 1 else None
    pp_point = profile.framework_at(pp) if pp > 1 else None
    pp_microbatch_s = pp_point.pp_microbatch_s if pp_point is not None else 0.0
    traffic = comm_per_step(layout, shape, workload)
    # Under ep the experts are FSDP units of their own, over the ranks holding the same experts (`parallel/fsdp.py`).
    expert_point = profile.framework_at(traffic["expert_dp"].group_size) if "expert_dp" in traffic else None
    inside = ({"fsdp"} if framework is not None else set()) | ({"expert_dp"} if expert_point is not None else set()) | (
        {"tp"} if tp_framework is not None else set()) | ({"pp"} if pp_microbatch_s else set())
    overhead += microbatches * pp_microbatch_s
    if tp_framework is not None:
        overhead += microbatches * _tp_overhead_s(holding.params, tp_framework, options.sequence_parallel)
    if fsdp and framework is not None:
        overhead += (blocks + 1) * microbatches * framework.fsdp_unit(over_dtensors=tp > 1)
    if expert_point is not None:  # the experts are DTensors over ep (`expert_parallel/dispatch.py`): a 2-D unit
        overhead += moe_blocks_held(shape, held) * microbatches * expert_point.fsdp_unit(over_dtensors=True)
    batch_ranks = dims["dp_replicate"] * dims["dp_shard"] * cp
    calls = sum(c.count for t in traffic.values() for c in t.calls) + (batch_ranks > 1)
    gap = (matmul + memory + overhead) * micro_steps / max(calls, 1)  # the rank's work between two calls
    comm = {dim: sum(c.count * _collective_s(profile, c.kind, t.group_size, c.buffer_bytes, dim in inside, gap)
                     for c in t.calls) for dim, t in traffic.items()}
    if batch_ranks > 1:  # the logged loss (``self.log(..., sync_dist=True)``), averaged over the batch ranks
        comm["loss"] = profile.collective_seconds("all_reduce", batch_ranks, LOGGED_BYTES, work_s=gap)
    local_params = sum(p.bytes for p in holding.params)
    adam = _adam_s(holding.params, framework if fsdp else tp_framework, profile.adam_tensor_s, fsdp)
    optimizer = profile.memory_seconds(local_params * OPTIMIZER_PASSES) + adam
    compute = (matmul + memory + overhead) * micro_steps
    bubble = theoretical_bubble(options.pp_schedule, pp, options.pp_microbatches,
                                options.pp_stages_per_rank) if pp > 1 else 0.0
    staged = sum(seconds for dim, seconds in comm.items() if dim not in ONCE_PER_STEP)
    once = sum(comm.get(dim, 0.0) for dim in ONCE_PER_STEP) + optimizer
    total = (compute + staged) / (1 - bubble) + once
    busy = profile.busy_share(gap)
    fill = 1.0
    if profile.oversubscribed:  # the cores are the bottleneck: a rank idle in the bubble lends its core to the others
        if pp > 1:
            chunks = chunks_per_rank(options.pp_schedule, options.pp_microbatches, options.pp_stages_per_rank)
            fill = shared_core_fill(pp, chunks, profile.processes, profile.cores)
        total = ((compute + staged) * fill + once) / busy
    flops = flops_per_token(shape, workload.seq_len) * batch * workload.seq_len * micro_steps * recompute / (tp * cp * pp)
    return StepTime(compute_s=compute + optimizer, comm_s=comm, link=dict.fromkeys(comm, "measured"),
                    exposed_comm_s=sum(comm.values()), bubble_fraction=bubble, total_s=total, flops_per_step=flops,
                    overhead_s=overhead * micro_steps, priced_by=profile_label(profile), busy_share=busy,
                    idle_fill=fill)


def shared_core_fill(stages: int, chunks: int, processes: int, cores: int) -> float:
    """How much longer than its work a pipeline stage takes where ``processes`` ranks share ``cores``: through the
    ``chunks + stages - 1`` slots of a schedule's chunks (microbatches x stages per rank, as its bubble counts them),
    1, 2, .. ``stages`` stages have work while it fills and as many fewer while it drains, in each of the
    ``processes / stages`` pipelines; a slot with k ranks working lasts max(cores, k) / processes of a chunk's time at
    the profile's speed (every rank running), so a stage waiting lends its core only where another has work. 1 where
    every slot keeps the cores busy (2 stages beside a batch dimension of 2 on 2 cores of 4 ranks), 1.125 for 4 stages
    of 4 microbatches on 2 cores."""
    replicas = max(1, processes // stages)
    working = [min(t + 1, stages, chunks, chunks + stages - 1 - t) for t in range(chunks + stages - 1)]
    return max(1.0, sum(max(cores, replicas * k) for k in working) / (processes * chunks))


def profile_label(profile: HostProfile) -> str:
    """How a table names what priced it: the host and the day it was measured."""
    return f"profile of {profile.host} (measured {profile.created[:10]})"


def _collective_s(profile: HostProfile, kind: str, group_size: int, nbytes: int, framework_measured: bool,
                  gap: float) -> float:
    """One call after ``gap`` of work; where a framework's measured call holds it (FSDP's, tp's: timed on tiny
    layers, hardly any work between calls), its bytes and what the longer wait after ``gap`` adds."""
    seconds = profile.collective_seconds(kind, group_size, nbytes, work_s=gap)
    if framework_measured:
        return seconds - profile.collective_seconds(kind, group_size, 0, work_s=0.0)
    return seconds


def _tp_overhead_s(params: tuple, point: FrameworkPoint, sequence_parallel: bool = False) -> float:
    """Each row-wise layer (and a vocabulary-split embedding) closes a measured column-wise / row-wise pair (with
    ``sequence_parallel``, the sequence-parallel block's: its norm and residual add on DTensors, where measured); the
    column-wise layers beyond one per pair (q, k, v before one output projection) cost their DTensor operations."""
    split = [p for p in params if len(p.shape) == 2 and "tp:" in p.placement]
    rowwise = sum("tp:Shard(1)" in p.placement or p.kind == "embedding" for p in split)
    extra = max(len(split) - 2 * rowwise, 0)
    pair = point.tp_sp_pair_s if sequence_parallel and point.tp_sp_pair_s else point.tp_pair_s
    return rowwise * pair + extra * DTENSOR_OPS_PER_LINEAR * point.dtensor_op_s


def _adam_s(params: tuple, dtensor: FrameworkPoint | None, plain: float | None, fsdp: bool) -> float:
    """AdamW's per-tensor overhead over this rank's parameters: DTensors where FSDP or tp made them so."""
    return sum(dtensor.dtensor_adam_s if dtensor is not None and (fsdp or "tp:" in p.placement) else plain or 0.0
               for p in params)


def _block_matmuls(shape: ModelShape, tokens: int, batch: int, seq: int, tp: int, ep: int,
                   attention: bool = True) -> list[tuple[int, int, int, int]]:
    """(m, n, k, how many) of one block's forward matmuls, each x3 for its backward (``attention``: with the
    attention's two, where the profile did not measure attention itself)."""
    h, kv, inner = shape.hidden, shape.kv_dim, shape.intermediate
    heads = max(1, shape.heads // tp)
    shapes = [(tokens, (h + 2 * kv) // tp, h, 3), (tokens, h, h // tp, 3)]
    if attention:
        shapes += [(seq, seq, shape.head_dim, 3 * batch * heads), (seq, shape.head_dim, seq, 3 * batch * heads)]
    mlp = 3 if shape.mlp == "gated" else 2
    if shape.experts:
        local = max(1, shape.experts // ep)
        rows = max(1, tokens * shape.top_k * ep // shape.experts)
        shapes += [(rows, inner // tp, h, 3 * local * (mlp - 1)), (rows, h, inner // tp, 3 * local),
                   (tokens, shape.experts, h, 3)]
    else:
        shapes += [(tokens, inner // tp, h, 3 * (mlp - 1)), (tokens, h, inner // tp, 3)]
    return shapes


def _elementwise_bytes(shape: ModelShape, seq: int, tp: int) -> int:
    """Elements one token's forward through a block reads and writes outside its matmuls."""
    h, inner = shape.hidden, shape.intermediate * (shape.top_k if shape.experts else 1)
    return 2 * 2 * h + 2 * 2 * h + 2 * (h + 2 * shape.kv_dim) // tp + 3 * (shape.heads // tp) * seq + 3 * inner // tp
