"""What one host was measured to do: `HostProfile`, a small JSON file a user can read and share, and where it is
cached (``cache_path(backend)``, ``cached_profile(backend)``). ``calibrate.py`` measures it.

    profile = HostProfile.load("my_host.json")
    profile.matmul_seconds(4096, 4096, 4096, "bfloat16"), profile.collective_seconds("all_reduce", 8, 2**30)

Every time is what one process took with the profile's ``processes`` running at once, as a layout runs them. A
collective is priced as nccl-tests' doc/PERFORMANCE.md models it, time = latency + bytes / bandwidth, fitted to the
times measured at several sizes; ``bytes`` is the whole buffer (the tensor of an all-reduce or a broadcast, the
gathered output of an all-gather, the input of a reduce-scatter, one rank's input to an all-to-all, the message of
a send), the ``B`` of ``comm.py``.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_nd.cost.collective_fit import CollectiveFit, piecewise_linear

SCHEMA = 5
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
RECALIBRATE = "python -m lightning_nd.plan --calibrate"


@dataclass(frozen=True)
class MatmulPoint:
    """One matmul shape, [m, k] @ [k, n], measured in one dtype."""

    m: int
    n: int
    k: int
    dtype: str
    flops_per_s: float
    """2 x m x n x k per call over the seconds per call, the call's own eager overhead included."""

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


@dataclass(frozen=True)
class AttentionPoint:
    """Causal attention's forward and backward over ``batch_heads`` heads of ``seq`` tokens of ``head_dim``."""

    batch_heads: int
    seq: int
    head_dim: int
    seconds: float


@dataclass(frozen=True)
class FrameworkPoint:
    """The parallel frameworks' own cost per call over groups of ``group_size`` ranks, on tiny tensors
    (`framework_benchmarks.py`)."""

    group_size: int
    fsdp_unit_s: float
    """One FSDP2 unit's forward and backward beyond the same layer's without FSDP: hooks and the unit's three
    collectives at a few bytes."""
    dtensor_op_s: float
    """One DTensor operation and its backward."""
    dtensor_adam_s: float
    """AdamW's update of one DTensor parameter."""
    tp_pair_s: float = 0.0
    """A column-wise then row-wise parallel linear pair's forward and backward beyond the unsplit pair's: DTensor
    wrapping and the pair's two all-reduces, as the ranks drift in a step."""
    tp_sp_pair_s: float = 0.0
    """A sequence-parallel block's norm, column-wise and row-wise pair and residual add, beyond the same unsplit: the
    pair's all-gather and reduce-scatter and the norm's and add's DTensor operations, as the ranks drift in a step."""
    pp_microbatch_s: float = 0.0
    """One microbatch more through a 1F1B pipeline of ``group_size`` stages of tiny layers: the schedule's actions
    and each stage's exchanges of the activation and its gradient, as the ranks drift in a step."""
    fsdp_tp_unit_s: float = 0.0
    """One FSDP2 unit over ``group_size`` ranks whose parameters are tensor parallel over 2 more (DTensors on a 2-D
    mesh) beyond the same blocks without FSDP: the DTensor shards' gathers and the tp ranks waiting on the FSDP
    ranks'; 0 where the calibration's world could not hold the mesh."""

    def fsdp_unit(self, over_dtensors: bool) -> float:
        """One FSDP unit's price: the 2-D unit's where its parameters are DTensors (tp's, or ep's experts) and it was
        measured, else the plain unit's."""
        return self.fsdp_tp_unit_s if over_dtensors and self.fsdp_tp_unit_s else self.fsdp_unit_s


@dataclass(frozen=True)
class HostProfile:
    """What one host measured: matmul, memory-bound and eager-overhead throughput of one process among
    ``processes``, and every collective's latency and bandwidth per group size."""

    host: str
    torch: str
    backend: str
    """``gloo`` (CPU) or ``nccl`` (GPU): the backend the collectives ran on."""
    device: str
    """What ran the compute: the GPU's name, or the CPU's and its threads per process."""
    created: str
    """ISO 8601 time the calibration finished."""
    calibration_s: float
    processes: int
    """Processes running at once while measuring (as many as the layouts start on this host)."""
    matmul: tuple[MatmulPoint, ...]
    memory_bytes_per_s: float
    """Bytes read plus written per second by an elementwise add of tensors larger than the caches."""
    op_overhead_s: float
    """Seconds per aten operation of a small training forward and backward (autograd included): the price of
    each operation `op_count.py` counts."""
    collectives: tuple[CollectiveFit, ...]
    framework: tuple[FrameworkPoint, ...] = ()
    """FSDP, DTensor and AdamW overheads per group size (CPU only: on GPU they overlap the kernels)."""
    adam_tensor_s: float | None = None
    """AdamW's update of one plain parameter."""
    attention: tuple[AttentionPoint, ...] = ()
    """Attention's forward and backward as measured (at least two shapes, a small head's and a larger one's)."""
    cores: int = 0
    """Cores the processes could run on (0: not recorded)."""
    utilization: tuple[tuple[float, float], ...] = ()
    """``(seconds of work between two collective calls, share of the cores busy)``, measured over the loops that time
    a collective inside a step (`in_step_benchmarks.py`): the processes' processor time over the cores' wall time."""
    schema: int = SCHEMA

    def __post_init__(self) -> None:
        numbers = [self.calibration_s, self.memory_bytes_per_s, self.op_overhead_s,
                   *(p.flops_per_s for p in self.matmul),
                   *(v for c in self.collectives for v in (c.latency_s, c.bytes_per_s)),
                   *(v for point in self.utilization for v in point)]
        if not self.matmul or not all(math.isfinite(v) and v > 0 for v in numbers):
            raise ValueError("A `HostProfile` needs at least one matmul and every time and throughput positive and"
                             " finite.")
        if any(share > 1 for _, share in self.utilization):
            raise ValueError(f"A share of the cores busy is at most 1, not {sorted(s for _, s in self.utilization)}.")
        unknown = {c.kind for c in self.collectives} - set(COLLECTIVES)
        if unknown:
            raise ValueError(f"Unknown collectives {sorted(unknown)}: the profile knows {', '.join(COLLECTIVES)}.")

    def matmul_seconds(self, m: int, n: int, k: int, dtype: str) -> float:
        """Seconds of one [m, k] @ [k, n] in ``dtype``: log(seconds) interpolated linearly in log(FLOPs) between
        the two measured shapes around it, with the measured times first made non-decreasing in FLOPs (a larger
        matmul is never priced faster than a smaller one); outside the measured range, at the throughput of the
        nearest measured shape."""
        points = sorted((p for p in self.matmul if p.dtype == dtype), key=lambda p: p.flops)
        if not points:
            measured = sorted({p.dtype for p in self.matmul})
            raise ValueError(f"The profile of `{self.host}` measured no `{dtype}` matmul, only {measured}. HINT:"
                             f" calibrate with `dtypes=({', '.join(repr(d) for d in {*measured, dtype})})`.")
        flops, times, slowest = [], [], 0.0
        for point in points:
            slowest = max(slowest, point.flops / point.flops_per_s)
            flops.append(math.log(point.flops))
            times.append(math.log(slowest))
        wanted = math.log(2 * m * n * k)
        if wanted <= flops[0]:
            return math.exp(times[0] + wanted - flops[0])
        if wanted >= flops[-1]:
            return math.exp(times[-1] + wanted - flops[-1])
        upper = next(i for i, f in enumerate(flops) if f >= wanted)
        share = (wanted - flops[upper - 1]) / (flops[upper] - flops[upper - 1])
        return math.exp(times[upper - 1] + share * (times[upper] - times[upper - 1]))

    def attention_seconds(self, batch_heads: int, seq: int, head_dim: int) -> float | None:
        """Causal attention's forward and backward: each query row costs a fixed time plus one per key and channel,
        ``batch_heads x seq x (row + seq x head_dim x per_key_channel)``, both fitted to the measured points (least
        squares on the per-row times, kept positive); None when the profile measured no attention."""
        points = [(p.seq * p.head_dim, p.seconds / (p.batch_heads * p.seq)) for p in self.attention]
        if len(points) < 2:
            return None
        mean_x = sum(x for x, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        spread = sum((x - mean_x) ** 2 for x, _ in points)
        slope = max(sum((x - mean_x) * (y - mean_y) for x, y in points) / spread, 0.0) if spread else 0.0
        row = max(mean_y - slope * mean_x, 0.0)
        return batch_heads * seq * (row + slope * seq * head_dim)

    def memory_seconds(self, nbytes: float) -> float:
        """Seconds of a memory-bound op that reads and writes ``nbytes`` in all."""
        return nbytes / self.memory_bytes_per_s

    def collective_seconds(self, kind: str, group_size: int, nbytes: float, work_s: float | None = None) -> float:
        """Seconds of one ``kind`` of ``nbytes`` over ``group_size`` ranks (``work_s``: called inside a step after
        that much work, see `CollectiveFit.in_step`); 0 for one rank. A group size not measured is priced as the
        nearest measured one (the larger on a tie)."""
        if kind not in COLLECTIVES:
            raise ValueError(f"Unknown collective `{kind}`. HINT: one of {', '.join(COLLECTIVES)}.")
        if group_size <= 1:
            return 0.0
        fits = [c for c in self.collectives if c.kind == kind]
        if not fits:
            raise ValueError(f"The profile of `{self.host}` measured no `{kind}` (it ran with {self.processes}"
                             f" process(es)). HINT: calibrate with at least 2 processes: `{RECALIBRATE}`.")
        nearest = min(fits, key=lambda c: (abs(c.group_size - group_size), -c.group_size))
        return nearest.seconds(nbytes, work_s)

    @property
    def oversubscribed(self) -> bool:
        """Whether the processes outnumbered the cores, so every time is one process's while it shared a core."""
        return 0 < self.cores < self.processes

    def busy_share(self, work_s: float) -> float:
        """The share of the cores a step keeps busy when its ranks work ``work_s`` between two collective calls: 1
        where the processes did not outnumber the cores or it was not measured, else interpolated linearly between
        the measured amounts of work (the nearest outside them). A rank waiting for a call gives its core up, and
        while the others wait too the core idles: 0.72-0.88 of the 2 cores busy through steps of 4 ranks."""
        if not self.oversubscribed or not self.utilization:
            return 1.0
        return piecewise_linear(sorted(self.utilization), work_s)

    def framework_at(self, group_size: int) -> FrameworkPoint | None:
        """The framework overheads measured at the nearest group size (the larger on a tie); None if none were."""
        if not self.framework:
            return None
        return min(self.framework, key=lambda p: (abs(p.group_size - group_size), -p.group_size))

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["collectives"] = [{**c, "samples": [list(s) for s in c["samples"]],
                                  "in_step": [list(p) for p in c["in_step"]]} for c in record["collectives"]]
        return {"schema": record.pop("schema"), **record}

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> HostProfile:
        fields = dict(record)
        fields["matmul"] = tuple(MatmulPoint(**p) for p in record["matmul"])
        fields["collectives"] = tuple(CollectiveFit(**{**c, "samples": tuple(tuple(s) for s in c["samples"]),
                                                       "in_step": tuple(tuple(p) for p in c.get("in_step", ()))})
                                      for c in record["collectives"])
        fields["framework"] = tuple(FrameworkPoint(**p) for p in record.get("framework", ()))
        fields["attention"] = tuple(AttentionPoint(**p) for p in record.get("attention", ()))
        fields["utilization"] = tuple(tuple(point) for point in record.get("utilization", ()))
        return cls(**fields)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the profile as indented JSON (its folders made), through a temporary file so a reader never sees
        half of it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        partial.replace(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> HostProfile:
        """Read a profile; a file of another schema, or not a profile at all, is refused naming the fix."""
        try:
            record = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"`{path}` is not a readable profile ({error}). HINT: measure this host again with"
                             f" `{RECALIBRATE}`, or pass another `--profile`.") from None
        schema = record.get("schema") if isinstance(record, dict) else None
        if schema != SCHEMA:
            raise ValueError(f"`{path}` is a profile of schema {schema}, this version reads schema {SCHEMA}. HINT:"
                             f" measure this host again with `{RECALIBRATE}` (it overwrites the cached one).")
        try:
            return cls.from_dict(record)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"`{path}` is not a valid profile ({type(error).__name__}: {error}). HINT: measure this"
                             f" host again with `{RECALIBRATE}`.") from None


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def cache_path(backend: str) -> Path:
    """Where this host's profile for ``backend`` is cached: ``$LIGHTNING_ND_PROFILE_DIR``, else
    ``${XDG_CACHE_HOME:-~/.cache}/lightning_nd/profiles``, in a file named for the host, the torch version and the
    backend, so a change of any of them is a file not yet measured."""
    chosen = os.environ.get("LIGHTNING_ND_PROFILE_DIR")
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    folder = Path(chosen) if chosen else Path(cache) / "lightning_nd" / "profiles"
    name = f"{socket.gethostname()}-torch{torch.__version__}-{backend}"
    return folder / (re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".json")


def cached_profile(backend: str) -> HostProfile | None:
    """This host's cached profile for ``backend``, or None when there is none, it is of another schema (an older
    version measured less) or unreadable, or it was measured by another host, torch or backend (two names can share
    a file name once made safe for a file system)."""
    path = cache_path(backend)
    if not path.exists():
        return None
    try:
        profile = HostProfile.load(path)
    except ValueError:
        return None
    if (profile.host, profile.torch, profile.backend) != (socket.gethostname(), torch.__version__, backend):
        return None
    return profile
