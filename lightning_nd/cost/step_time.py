"""How long one optimizer step takes on given hardware, by arithmetic: ``step_time(layout, shape, workload, ...)``.

- Compute: the PaLM accounting (as ``benchmarks/mfu.py``): 6 x active parameters + 12 x layers x hidden x
  seq_len FLOPs per token for forward and backward; x 4/3 under full activation checkpointing (the forward again);
  selective checkpointing keeps every matmul and attention output and recomputes only elementwise ops, which
  the count leaves out, so it adds nothing. A batch rank's tokens (batch x seq_len x accumulation) are shared
  by its tp x cp x pp ranks; every dp rank runs its own. Time = FLOPs / ``peak_flops``: peak, no efficiency
  factor, so compute (like the links, at peak bandwidth too) is a lower bound; compare layouts with it.
- Communication: rank 0's bytes per dim (`comm.comm_per_step`) over the dim's link: NVLink when every group
  of that role sits inside one node (ranks r and s share a node when r // gpus_per_node == s // gpus_per_node),
  else the network.
- Overlap: FSDP, dp_replicate and expert_dp collectives run beside the compute (prefetched all-gathers,
  reduce-scatters behind backward), so only what they take beyond the compute is exposed; tp, cp, ep and pp
  sit on the critical path, all exposed.
- Bubble: ``theoretical_bubble``: (p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(v x m+p-1) with v stages per rank
  for the looped schedules. The zero-bubble ones (interleaved_zero_bubble, zbv, dualpipev) get the same
  interleaved formula: an upper bound, as they fill part of the bubble with weight-gradient work.
- Total = (compute + exposed communication) / (1 - bubble).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_nd.cost.comm import comm_per_step
from lightning_nd.cost.hardware import Hardware
from lightning_nd.cost.shape import ModelShape, Workload
from lightning_nd.layout.record import Layout
from lightning_nd.pipeline_parallel.schedules import theoretical_bubble

OVERLAPPED = ("fsdp", "dp_replicate", "expert_dp")
RECOMPUTE_FACTOR = {"none": 1.0, "selective": 1.0, "full": 4 / 3}


@dataclass(frozen=True)
class StepTime:
    """One optimizer step of one rank, in seconds."""

    compute_s: float
    comm_s: dict[str, float]
    """Per mesh dim: its bytes over its link's bandwidth."""
    link: dict[str, str]
    """Per mesh dim: ``nvlink`` (every group inside one node) or ``network``."""
    exposed_comm_s: float
    """The communication not hidden behind compute."""
    bubble_fraction: float
    total_s: float
    flops_per_step: float
    """The FLOPs this rank executes per step (recomputation included)."""
    overhead_s: float = 0.0
    """Eager per-operation overhead (a measured profile's; datasheet presets count none)."""
    priced_by: str = ""
    """What priced it: a preset's name or ``profile of <host>``."""
    busy_share: float = 1.0
    """The share of the cores the ranks keep busy through the step, where a measured profile's ranks outnumber its
    cores (`HostProfile.busy_share`); 1 elsewhere."""
    idle_fill: float = 1.0
    """There, how much longer the stage's work takes while the pipeline fills and drains with fewer stages working
    than cores (`profiled_step.shared_core_fill`); 1 elsewhere."""


def flops_per_token(shape: ModelShape, seq_len: int) -> int:
    """Forward and backward FLOPs of one token (PaLM: 6 N_active + 12 L h s)."""
    return 6 * shape.active_params + 12 * shape.layers * shape.hidden * seq_len


def step_time(layout: Layout, shape: ModelShape, workload: Workload, hardware: Hardware,
              gpus_per_node: int) -> StepTime:
    """The step time of ``layout`` on ``hardware`` with ``gpus_per_node`` consecutive ranks per node."""
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"`gpus_per_node={gpus_per_node!r}` must be a positive int. HINT: e.g. 8 for a DGX node.")
    dims, options = layout.dims, layout.options
    tokens = workload.batch * workload.seq_len * workload.accumulation
    recompute = RECOMPUTE_FACTOR[options.activation_checkpointing]
    flops = flops_per_token(shape, workload.seq_len) * tokens * recompute / (dims["tp"] * dims["cp"] * dims["pp"])
    compute_s = flops / hardware.peak_flops
    comm_s, link = {}, {}
    for dim, traffic in comm_per_step(layout, shape, workload, rank=0).items():
        link[dim] = "nvlink" if within_nodes(layout.roles[dim], gpus_per_node) else "network"
        bandwidth = hardware.intra_node_bytes_per_s if link[dim] == "nvlink" else hardware.inter_node_bytes_per_s
        comm_s[dim] = traffic.bytes / bandwidth
    overlapped_s = sum(seconds for dim, seconds in comm_s.items() if dim in OVERLAPPED)
    critical_s = sum(seconds for dim, seconds in comm_s.items() if dim not in OVERLAPPED)
    exposed_s = critical_s + max(0.0, overlapped_s - compute_s)
    bubble = (theoretical_bubble(options.pp_schedule, dims["pp"], options.pp_microbatches,
                                 options.pp_stages_per_rank) if dims["pp"] > 1 else 0.0)
    return StepTime(compute_s=compute_s, comm_s=comm_s, link=link, exposed_comm_s=exposed_s, bubble_fraction=bubble,
                    total_s=(compute_s + exposed_s) / (1 - bubble), flops_per_step=flops, priced_by=hardware.name)


def within_nodes(groups: list[list[int]], gpus_per_node: int) -> bool:
    """Whether every group's ranks share one node."""
    return all(len({rank // gpus_per_node for rank in group}) == 1 for group in groups)
