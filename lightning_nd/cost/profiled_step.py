"""How long one optimizer step takes on the host a `HostProfile` measured (``plan --calibrate``):
``profiled_step_time(layout, shape, workload, profile, ops)``. Where `step_time.py` divides FLOPs by a datasheet
peak, this prices what a small or medium model's eager step on that host is made of, per rank:

- **Matmuls** at this rank's shapes (tp splits the heads and the MLP's inner size, cp the tokens, pp the blocks):
  each block's projections, attention's scores and weighted values (at full size: the CPU kernels compute the
  masked half too), the head over the vocabulary, an MoE block's routed rows through its local experts; each
  forward matmul and its two backward ones priced by the profile's throughput at that size.
- **Memory-bound operations**: per block and token, the norms, residual adds, rotary embedding, softmax over the
  sequence and the MLP's activation, read and written once forward and twice backward; the optimizer's update
  (AdamW: parameter, gradient, two moments, read and written).
- **Eager overhead**: the operations one micro-batch's forward and backward run, counted on the model itself
  (`op_count.py`; `OPS_PER_BLOCK` and `OPS_PER_EXPERT` when the forward does not run on the meta device), x the
  profile's time per operation. A DTensor operation costs more than a plain one; the profile does not measure it yet.
- **Frameworks** (where the profile measured them, on CPU): each FSDP unit's hooks and collectives per forward and
  backward pass; each tensor-parallel column-wise / row-wise pair as measured, and the DTensor operations of the
  column-wise layers beyond one per pair (a transpose, matmul and bias add each, with their backward); AdamW's
  update per parameter tensor (a DTensor one where FSDP or tp made it one).
- **Collectives**: every call `comm.py` lists, latency + buffer / bandwidth at its group size (FSDP's and tp's at
  bandwidth only: their latency is in the unit's or the pair's measured time). Nothing overlaps: the profile does not measure how much a
  collective hides behind compute on this host.
- **Pipeline**: the stage's work over all microbatches / (1 - bubble), as `step_time.py`.
"""

from __future__ import annotations

from lightning_nd.cost.comm import comm_per_step
from lightning_nd.cost.op_count import OpCount
from lightning_nd.cost.profile import FrameworkPoint, HostProfile
from lightning_nd.cost.shape import ModelShape, Workload
from lightning_nd.cost.step_time import RECOMPUTE_FACTOR, StepTime, flops_per_token
from lightning_nd.layout.record import Layout
from lightning_nd.pipeline_parallel.schedules import theoretical_bubble

OPS_PER_BLOCK = 250
"""Forward and backward operations of a block whose count could not be read (a data-dependent MoE dispatch): the
middle of the dense blocks counted (the example GPT's 171, LitGPT Llama 3's 254, HF Mistral's 267, the example
Llama's 304)."""
OPS_PER_EXPERT = 30
"""More per local expert of such a block: an expert's three projections and activation, forward and backward."""
FSDP_DIMS = ("fsdp", "expert_dp")
DTENSOR_OPS_PER_LINEAR = 3
"""DTensor operations of one tensor-parallel linear layer's forward (the weight's transpose, the matmul, the bias add;
`F.linear` decomposes so on a DTensor), each priced with its backward by the profile's ``dtensor_op_s``."""
OPTIMIZER_PASSES = 8
"""AdamW's update reads and writes the parameter and two moments and reads the gradient."""


def profiled_step_time(layout: Layout, shape: ModelShape, workload: Workload, profile: HostProfile,
                       ops: OpCount | None, dtype: str = "float32") -> StepTime:
    """Rank 0's step of ``layout`` on the profile's host; ``ops``: the model's counted operations, if any."""
    dims, options = layout.dims, layout.options
    tp, cp, pp = dims["tp"], dims["cp"], dims["pp"]
    holding = layout.rank(0)
    blocks = _blocks_on(layout, holding.stages) if layout.pipeline is not None else shape.layers
    first = layout.pipeline is None or 0 in holding.stages
    last = layout.pipeline is None or layout.pipeline.num_stages - 1 in holding.stages
    micro_steps, batch = workload.accumulation, workload.batch
    tokens = batch * workload.seq_len // cp
    recompute = RECOMPUTE_FACTOR[options.activation_checkpointing]
    matmul = sum(profile.matmul_seconds(m, n, k, dtype) * count for m, n, k, count in
                 _block_matmuls(shape, tokens, batch, workload.seq_len // cp, tp, dims.get("ep", 1)))
    matmul = matmul * blocks * recompute
    if last:
        matmul += 3 * profile.matmul_seconds(tokens, shape.vocab // (tp if options.loss_parallel else 1), shape.hidden,
                                             dtype)
    elementwise = _elementwise_bytes(shape, workload.seq_len // cp, tp) * tokens * workload.activation_bytes
    memory = profile.memory_seconds(elementwise * 3 * blocks)
    counted = (ops.per_block[0] if ops is not None and ops.per_block
               else OPS_PER_BLOCK + OPS_PER_EXPERT * shape.experts // dims.get("ep", 1))
    outside = (ops.outside if ops is not None else 2 * OPS_PER_BLOCK) * (first or last)
    microbatches = options.pp_microbatches if pp > 1 else 1
    overhead = profile.op_overhead_s * (counted * blocks + outside) * microbatches
    fsdp = "fsdp" in {t.technique for t in layout.techniques}
    framework = profile.framework_at(dims["dp_shard"] * cp)
    tp_framework = profile.framework_at(tp) if tp > 1 else None
    inside = {dim for dim in FSDP_DIMS if framework is not None} | ({"tp"} if tp_framework is not None else set())
    comm = {dim: sum(c.count * _collective_s(profile, c.kind, traffic.group_size, c.buffer_bytes, dim in inside)
                     for c in traffic.calls) for dim, traffic in comm_per_step(layout, shape, workload).items()}
    local_params = sum(p.bytes for p in holding.params)
    adam = _adam_s(holding.params, framework if fsdp else tp_framework, profile.adam_tensor_s, fsdp)
    optimizer = profile.memory_seconds(local_params * OPTIMIZER_PASSES) + adam
    if tp_framework is not None:
        overhead += microbatches * _tp_overhead_s(holding.params, tp_framework)
    if fsdp and framework is not None:
        overhead += (blocks + 1) * microbatches * framework.fsdp_unit_s
    compute = (matmul + memory + overhead) * micro_steps
    bubble = theoretical_bubble(options.pp_schedule, pp, options.pp_microbatches,
                                options.pp_stages_per_rank) if pp > 1 else 0.0
    staged = sum(seconds for dim, seconds in comm.items() if dim != "pp")
    total = (compute + staged) / (1 - bubble) + comm.get("pp", 0.0) + optimizer
    flops = flops_per_token(shape, workload.seq_len) * batch * workload.seq_len * micro_steps * recompute / (tp * cp * pp)
    return StepTime(compute_s=compute + optimizer, comm_s=comm, link=dict.fromkeys(comm, "measured"),
                    exposed_comm_s=sum(comm.values()), bubble_fraction=bubble, total_s=total, flops_per_step=flops,
                    overhead_s=overhead * micro_steps, priced_by=profile_label(profile))


def profile_label(profile: HostProfile) -> str:
    """How a table names what priced it: the host and the day it was measured."""
    return f"profile of {profile.host} (measured {profile.created[:10]})"


def _collective_s(profile: HostProfile, kind: str, group_size: int, nbytes: int, bandwidth_only: bool) -> float:
    seconds = profile.collective_seconds(kind, group_size, nbytes)
    return seconds - profile.collective_seconds(kind, group_size, 0) if bandwidth_only else seconds


def _tp_overhead_s(params: tuple, point: FrameworkPoint) -> float:
    """Each row-wise layer (and a vocabulary-split embedding) closes a measured column-wise / row-wise pair; the
    column-wise layers beyond one per pair (q, k, v before one output projection) cost their DTensor operations."""
    split = [p for p in params if len(p.shape) == 2 and "tp:" in p.placement]
    rowwise = sum("tp:Shard(1)" in p.placement or p.kind == "embedding" for p in split)
    extra = max(len(split) - 2 * rowwise, 0)
    return rowwise * point.tp_pair_s + extra * DTENSOR_OPS_PER_LINEAR * point.dtensor_op_s


def _adam_s(params: tuple, dtensor: FrameworkPoint | None, plain: float | None, fsdp: bool) -> float:
    """AdamW's per-tensor overhead over this rank's parameters: DTensors where FSDP or tp made them so."""
    return sum(dtensor.dtensor_adam_s if dtensor is not None and (fsdp or "tp:" in p.placement) else plain or 0.0
               for p in params)


def _blocks_on(layout: Layout, stages: tuple[int, ...]) -> int:
    pipeline = layout.pipeline
    assert pipeline is not None
    units = {unit for stage in stages for unit in pipeline.split.stages[stage]}
    return sum(name in units for name in pipeline.split.blocks)


def _block_matmuls(shape: ModelShape, tokens: int, batch: int, seq: int, tp: int,
                   ep: int) -> list[tuple[int, int, int, int]]:
    """(m, n, k, how many) of one block's forward matmuls, each x3 for its backward."""
    h, kv, inner = shape.hidden, shape.kv_dim, shape.intermediate
    heads = max(1, shape.heads // tp)
    shapes = [(tokens, (h + 2 * kv) // tp, h, 3), (tokens, h, h // tp, 3),
              (seq, seq, shape.head_dim, 3 * batch * heads), (seq, shape.head_dim, seq, 3 * batch * heads)]
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
