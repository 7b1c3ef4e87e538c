"""What the parallel frameworks cost per call on this host, beside the arithmetic and the bytes: one calibration
process's steps (``micro_benchmarks.py`` runs them on every rank at once), on tiny tensors so only the overhead is
timed.

- ``training_op_s``: seconds per aten operation of a small forward and backward (autograd records and replays each
  operation), the price `op_count.py`'s counted operations are multiplied by.
- per group size, all groups of that size at once: ``fsdp_unit_s``, one FSDP2 unit's forward and backward (its
  hooks, the parameter all-gathers before forward and backward and the gradient reduce-scatter, at a few bytes,
  the ranks as they drift apart in a step rather than started together); ``dtensor_op_s``, one DTensor operation
  with its backward (sharding propagation, redistribution checks, wrapping); ``dtensor_adam_s``, AdamW's update of
  one DTensor parameter; ``tp_pair_s``, a column-wise then row-wise parallel linear pair's forward and backward
  beyond the same layers unsplit (torch's `ColwiseParallel`, `RowwiseParallel`: DTensor wrapping, the row-wise
  output's all-reduce and the column-wise input gradient's, the ranks drifting as in a step); ``pp_microbatch_s``,
  one microbatch more through a 1F1B pipeline of that many stages (the schedule's actions and exchanges);
  ``fsdp_tp_unit_s``, one FSDP2 unit over parameters tensor parallel over 2 more ranks (DTensors on a 2-D mesh, as
  FSDP shards a tp layout's), beyond the same sequence-parallel blocks without FSDP: where the world holds it;
- ``adam_tensor_s``: AdamW's update of one plain parameter.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

Timer = Callable[[Callable[[], Any], float], float]
"""Seconds per call of a call timed for about a number of seconds (`micro_benchmarks.Bench`'s two ways)."""
OVERHEADS = ("op_overhead_s", "adam_tensor_s", "framework")
"""What a rank's record of the calibration holds of the per-call overheads (`median_overheads`)."""
CHAIN = 5
"""Repeats of matmul, tanh, scale and residual add in the timed chains."""
UNITS = 4
"""Linear layers sharded as their own FSDP units, under a root unit."""
PIPELINE_EXTRA, PIPELINE_STEPS = 4, 6
"""Microbatches a pipeline is timed with beyond one per stage (the difference is priced per microbatch), and its
steps timed at each."""


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _chain(start: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    hidden = start
    for _ in range(CHAIN):
        hidden = torch.tanh(hidden @ weight) * 0.5 + hidden
    return hidden


def training_op_s(seconds_per_call: Timer, seconds: float) -> float:
    inputs = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(8, 8, requires_grad=True)

    def step() -> None:
        _chain(inputs, weight).sum().backward()

    counter = _Count()
    with counter:
        step()
    return seconds_per_call(step, seconds) / counter.calls


def _pipeline(mesh: Any) -> list[Callable[[], Any]]:
    """A step of a 1F1B pipeline over the mesh's ranks, one tiny linear layer per stage, at one microbatch per stage
    and at ``PIPELINE_EXTRA`` more: the schedule's actions, the activation's and the gradient's exchanges."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stages, index, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    steps: list[Callable[[], Any]] = []
    for microbatches in (stages, stages + PIPELINE_EXTRA):
        stage = PipelineStage(nn.Linear(8, 8), index, stages, torch.device("cpu"), group=group)
        schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=lambda output, _: output.sum())
        inputs = torch.randn(microbatches, 8)
        steps.append({0: partial(schedule.step, inputs), stages - 1: partial(schedule.step, target=inputs)}.get(
            index, schedule.step))
        steps[-1]()
    return steps


def _pipeline_microbatch_s(mesh: Any, steps: list[Callable[[], Any]]) -> float:
    """One more microbatch's cost to the pipeline (``_pipeline``), the ranks drifting as in a step. Every rank runs
    the same number of steps (a stage waits for its neighbours'), so the steps are counted, not timed."""
    import torch.distributed as dist

    timed = []
    for step in steps:
        dist.barrier(group=mesh.get_group())
        begin = time.perf_counter()
        for _ in range(PIPELINE_STEPS):
            step()
        timed.append((time.perf_counter() - begin) / PIPELINE_STEPS)
    return max(timed[1] - timed[0], 1e-9) / PIPELINE_EXTRA


ATTENTION_SHAPES = {"cpu": [(64, 32, 8), (8, 256, 64)], "cuda": [(64, 512, 64), (16, 2048, 128)]}
"""(batch x heads, sequence, head size) attention is timed at on each device: a small model's and a larger one's,
so the fit separates a row's fixed cost from its cost per key and channel."""


def attention_points(seconds_per_call: Timer, device: torch.device,
                     dtype: torch.dtype, seconds: float) -> list[list[float]]:
    """Causal `scaled_dot_product_attention`'s forward and backward at each of ``ATTENTION_SHAPES``: [[batch x
    heads, sequence, head size, seconds], ...]. On CPU with a small head it is far from matmul speed (a 32-token,
    8-channel head runs at a tenth of it), so it is measured, not priced by its FLOPs."""
    points = []
    for heads, seq, size in ATTENTION_SHAPES[device.type]:
        query, key, value = (torch.randn(1, heads, seq, size, device=device, dtype=dtype, requires_grad=True)
                             for _ in range(3))

        def step() -> None:
            torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True).sum().backward()

        points.append([heads, seq, size, seconds_per_call(step, seconds / len(ATTENTION_SHAPES[device.type]))])
    return points


def _sequence_parallel_blocks(mesh: Any) -> nn.Module:
    """``UNITS // 2`` blocks of a norm, a column-wise and a row-wise linear layer with a residual add, sequence
    parallel over ``mesh`` as a tp block with sequence parallelism runs (the norm on this rank's part of the sequence,
    an all-gather before the column-wise layer, a reduce-scatter after the row-wise one; its input a DTensor sharded
    along the sequence); unsplit when ``mesh`` is None."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            return hidden + self.down(torch.tanh(self.up(self.norm(hidden))))

    blocks = nn.Sequential(*(Block() for _ in range(UNITS // 2)))
    for block in blocks if mesh is not None else ():
        parallelize_module(block, mesh, {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                                         "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    return blocks


def _two_d_blocks(size: int, world: int) -> tuple[nn.Module, nn.Module, Any]:
    """The sequence-parallel blocks over a tp group of 2, FSDP-sharded over ``size`` ranks (each block a unit, under
    a root unit) and not, on a mesh (the rest, ``size``, 2), with their input sharded along the sequence: FSDP's
    all-gathers and reduce-scatters of DTensor shards, and the tp ranks waiting on the FSDP ranks' as in a step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world // (2 * size), size, 2), mesh_dim_names=("across", "shard", "tp"))
    sharded, tp_only = _sequence_parallel_blocks(mesh["tp"]), _sequence_parallel_blocks(mesh["tp"])
    for block in sharded:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(sharded, mesh=mesh["shard"])
    return sharded, tp_only, DTensor.from_local(torch.randn(2, 4, 8), mesh["tp"], [Shard(1)])


def _pairs() -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(8, 16) if i % 2 == 0 else nn.Linear(16, 8) for i in range(UNITS)))


class _GroupBench:
    """What is timed over one group size: built once (its device mesh is collective), timed in every round."""

    def __init__(self, size: int, world: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.size = size
        self.mesh = mesh = init_device_mesh("cpu", (world // size, size), mesh_dim_names=("across", "within"))["within"]
        self.model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(UNITS)))
        self.plain = nn.Sequential(*(nn.Linear(8, 8) for _ in range(UNITS)))
        for layer in self.model:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.batch = torch.randn(4, 8)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.start = distribute_tensor(torch.randn(4 * size, 8), mesh, [Shard(0)]).requires_grad_()
        self.weight = distribute_tensor(torch.randn(8, 8), mesh, [Replicate()]).requires_grad_()
        self.pairs, self.unsplit = _pairs(), _pairs()
        parallelize_module(self.pairs, mesh, {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                                              for i in range(len(self.pairs))})
        self.blocks, self.whole = _sequence_parallel_blocks(mesh), _sequence_parallel_blocks(None)
        self.rows = torch.randn(2, 4, 8)  # this rank's part of the sequence
        self.sequence = DTensor.from_local(self.rows, mesh, [Shard(1)])
        self.pipeline = _pipeline(mesh) if size > 1 else []
        self.two_d = _two_d_blocks(size, world) if 1 < size and world % (2 * size) == 0 else None

    def measure(self, timed: Timer, local: Timer, share: float) -> list[float]:
        """`FrameworkPoint`'s fields, in order: ``timed`` times calls with collectives (every rank as many),
        ``local`` the unsplit references (every rank until one deadline)."""
        sharded_s = timed(lambda: self.model(self.batch).sum().backward(), share)
        plain_s = local(lambda: self.plain(self.batch).sum().backward(), share / 4)
        adam_s = timed(self.optimizer.step, share / 2) / (2 * UNITS)
        chain_s = timed(lambda: _chain(self.start, self.weight).to_local().sum().backward(), share)
        split_s = timed(lambda: self.pairs(self.batch).sum().backward(), share)
        unsplit_s = local(lambda: self.unsplit(self.batch).sum().backward(), share / 4)
        sp_s = timed(lambda: self.blocks(self.sequence).to_local().sum().backward(), share)
        whole_s = local(lambda: self.whole(self.rows).sum().backward(), share / 4)
        microbatch_s = _pipeline_microbatch_s(self.mesh, self.pipeline) if self.pipeline else 0.0
        two_d_s = 0.0
        if self.two_d is not None:
            sharded, tp_only, sequence = self.two_d
            both_s = timed(lambda: sharded(sequence).to_local().sum().backward(), share)
            alone_s = timed(lambda: tp_only(sequence).to_local().sum().backward(), share)
            two_d_s = max(both_s - alone_s, 1e-9) / (UNITS // 2 + 1)
        return [self.size, max(sharded_s - plain_s, 1e-9) / (UNITS + 1), chain_s / (4 * CHAIN), adam_s,
                max(split_s - unsplit_s, 1e-9) / (len(self.pairs) // 2), max(sp_s - whole_s, 1e-9) / (UNITS // 2),
                microbatch_s, two_d_s]


class FrameworkBench:
    """Every rank builds it with the same arguments (each group size makes a device mesh: collective), then times it
    in rounds (`measure`) spread over the calibration: on a host whose ranks share its cores one window's numbers
    swing with the scheduler (a 4-rank FSDP unit 11-30 ms on the 2-core host), so the profile keeps each number's
    median over the rounds (`median_overheads`)."""

    def __init__(self, group_sizes: list[int], world: int) -> None:
        self.groups = [_GroupBench(size, world) for size in group_sizes]
        self.plain = nn.Sequential(*(nn.Linear(8, 8) for _ in range(UNITS)))
        self.plain(torch.randn(4, 8)).sum().backward()
        self.optimizer = torch.optim.AdamW(self.plain.parameters(), lr=1e-3)

    def measure(self, timed: Timer, local: Timer, seconds: float) -> dict[str, Any]:
        """One round: ``{"framework": [[group size, *overheads], ...], "adam_tensor_s": ...}``."""
        share = seconds / (sum(5 + 2 * (group.two_d is not None) for group in self.groups) + 1)
        return {"framework": [group.measure(timed, local, share) for group in self.groups],
                "adam_tensor_s": local(self.optimizer.step, share) / (2 * UNITS)}


def median_overheads(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Each per-call overhead's median over ``records``: one rank's rounds (``FrameworkBench.measure``'s, with
    ``training_op_s``'s under "op_overhead_s"), or the ranks' medians of theirs. Only the keys the first record has
    ("framework" and "adam_tensor_s" are not measured on GPU); a framework row keeps its group size."""
    first = {key: value for key, value in records[0].items() if key in OVERHEADS}
    merged: dict[str, Any] = {key: statistics.median(r[key] for r in records) for key in first if key != "framework"}
    if "framework" in first:
        merged["framework"] = [[point[0], *(statistics.median(r["framework"][i][j] for r in records)
                                            for j in range(1, len(point)))] for i, point in enumerate(first["framework"])]
    return merged
