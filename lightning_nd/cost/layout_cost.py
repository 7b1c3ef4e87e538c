"""`cost_layout`: everything the cost model says about one `Layout`, per rank, as one JSON-able record.

Memory per rank (`memory.py`), bytes per step per mesh dim (`comm.py`), and with a hardware preset or a measured
host profile the pipeline bubble and a step-time estimate (`step_time.py`, `profiled_step.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lightning_nd.cost.comm import DimTraffic, comm_per_step
from lightning_nd.cost.hardware import Hardware
from lightning_nd.cost.memory import RankMemory, rank_memories
from lightning_nd.cost.op_count import OpCount
from lightning_nd.cost.profile import HostProfile
from lightning_nd.cost.profiled_step import profiled_step_time
from lightning_nd.cost.shape import ModelShape, Workload
from lightning_nd.cost.step_time import StepTime, step_time
from lightning_nd.layout.record import Layout


@dataclass(frozen=True)
class LayoutCost:
    ranks: tuple[RankMemory, ...]
    comm: dict[str, DimTraffic]
    time: StepTime | None

    @property
    def peak(self) -> RankMemory:
        """The rank with the highest expected peak (the first of equals)."""
        return max(self.ranks, key=lambda memory: memory.peak_bytes)

    def to_dict(self) -> dict:
        return {
            "ranks": [memory.to_dict() for memory in self.ranks],
            "peak_rank": self.peak.rank, "peak_bytes": self.peak.peak_bytes,
            "comm_bytes": {dim: traffic.bytes for dim, traffic in self.comm.items()},
            "comm": {dim: asdict(traffic) for dim, traffic in self.comm.items()},
            "step_time": asdict(self.time) if self.time is not None else None,
        }


def cost_layout(layout: Layout, shape: ModelShape, workload: Workload, *, optimizer: str = "adamw",
                hardware: Hardware | None = None, gpus_per_node: int | None = None, profile: HostProfile | None = None,
                ops: OpCount | None = None) -> LayoutCost:
    """With ``profile`` (a host's measurement) the step time is priced by it (`profiled_step.py`, reading the
    model's counted operations ``ops``), else by the ``hardware`` preset's peaks (`step_time.py`)."""
    ranks = rank_memories(layout, shape, workload, optimizer=optimizer)
    comm = comm_per_step(layout, shape, workload)
    if profile is not None:
        time: StepTime | None = profiled_step_time(layout, shape, workload, profile, ops)
    elif hardware is not None:
        time = step_time(layout, shape, workload, hardware, gpus_per_node or layout.dims["world_size"])
    else:
        time = None
    return LayoutCost(ranks, comm, time)

