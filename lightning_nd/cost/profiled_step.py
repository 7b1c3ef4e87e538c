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
- **Collectives**: every call `comm.py` lists, latency + buffer / bandwidth at its group size. Nothing overlaps:
  the profile does not measure how much a collective hides behind compute on this host.
- **Pipeline**: the stage's work over all microbatches / (1 - bubble), as `step_time.py`.
"""

from __future__ import annotations

from lightning_nd.cost.comm import comm_per_step
from lightning_nd.cost.op_count import OpCount
from lightning_nd.cost.profile import HostProfile
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
    comm = {dim: sum(c.count * profile.collective_seconds(c.kind, traffic.group_size, c.buffer_bytes)
                     for c in traffic.calls) for dim, traffic in comm_per_step(layout, shape, workload).items()}
    local_params = sum(p.bytes for p in holding.params)
    optimizer = profile.memory_seconds(local_params * OPTIMIZER_PASSES)
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
