"""One calibration process: ``python -m lightning_nd.cost.micro_benchmarks PLAN RANK``, started by ``calibrate.py``
once per rank, all at the same time. PLAN is the JSON file `calibrate` writes (what to measure, the backend, the
`FileStore`'s file, the deadline); each rank writes what it measured to ``rank<RANK>.json`` beside it, and rank 0
prints one progress line per step on stdout.

Each step runs on every rank at once: the compute steps (memory-bound add, each matmul) and the per-call overheads'
rounds (`ROUNDS`) run for a share of the time left and count calls; each collective runs on every group of its size
together (on 4 ranks, groups of 2 are ranks [0, 1] and [2, 3]) for as many timed repetitions as rank 0 decides from a
first timed call, each repetition started together by a small all-reduce, its median kept. Rank 0 decides what runs
and broadcasts it, so every rank calls the same collectives.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_nd.cost.framework_benchmarks import FrameworkBench, attention_points, median_overheads, training_op_s
from lightning_nd.cost.in_step_benchmarks import in_step_steps

SHARES = {"overhead": 0.04, "memory": 0.06, "matmul": 0.18, "attention": 0.05, "framework": 0.15}
"""Of the time left once the processes have started, what each compute step may spend (the matmuls twice as much
without collectives; the overheads over all their rounds); the collectives take the rest."""
ROUNDS = 3
"""Rounds the per-call overheads (an eager training operation's, the parallel frameworks') are timed in: before the
compute steps, between them and the collectives as inside a step, and between those and the other collectives
(`main`). Each is a short window whose number swings with the scheduler where the ranks outnumber the cores; the profile
keeps their median."""
MIN_REPETITIONS, MAX_REPETITIONS = 2, 50
MEMORY_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}
"""float32 elements per operand of the memory-bound add: 16 MiB on CPU (past the last-level cache), 256 MiB on GPU."""


class Bench:
    """This rank's view of the calibration: its device, the time left, and the agreement with rank 0."""

    def __init__(self, plan: dict[str, Any], rank: int) -> None:
        self.plan, self.rank, self.world = plan, rank, plan["processes"]
        self.cuda = plan["backend"] == "nccl"
        self.device = torch.device("cuda", rank % torch.cuda.device_count()) if self.cuda else torch.device("cpu")
        self.deadline = plan["deadline"]
        self.groups: dict[int, Any] = {}
        self.members: dict[int, list[int]] = {}

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def agree(self, *values: float) -> list[float]:
        """Rank 0's ``values`` on every rank."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.broadcast(tensor, src=0)
        return tensor.tolist()

    def say(self, line: str) -> None:
        if self.rank == 0:
            print(f"calibrating: {line}", flush=True)

    def left(self) -> float:
        return self.deadline - time.time()

    def seconds_per_local_call(self, call: Callable[[], Any], seconds: float) -> float:
        """One warm-up call, then calls until a deadline rank 0 sets ``seconds`` ahead (at least two): the seconds
        per call of one without collectives, every rank busy through the whole window as through a step. (Counted
        batches, as `seconds_per_call` makes, let the ranks that end their batch first wait while the others run on
        more of the cores: an eager operation 15% cheaper on the 2-core host with 4 ranks.)"""
        call()
        self.sync()
        (deadline,) = self.agree(time.time() + seconds)
        count, begin = 0, time.perf_counter()
        while count < 2 or time.time() < deadline:
            call()
            count += 1
        self.sync()
        return (time.perf_counter() - begin) / count

    def seconds_per_call(self, call: Callable[[], Any], seconds: float) -> float:
        """One warm-up call, then calls in growing batches until ``seconds`` have passed (at least two calls):
        the seconds per call, started with every rank. Rank 0 decides each batch's size and when to stop, so every
        rank makes as many calls (a call with collectives would wait forever for a rank that stopped sooner)."""
        call()
        self.sync()
        dist.barrier()
        count, elapsed, batch = 0, 0.0, 1
        while True:
            start = time.perf_counter()
            for _ in range(batch):
                call()
            self.sync()
            count += batch
            elapsed += time.perf_counter() - start
            wanted = max(1, min(count, int((seconds - elapsed) * count / max(elapsed, 1e-9))))
            done, batch = self.agree(float(elapsed >= seconds and count >= 2), wanted)
            if done:
                return elapsed / count
            batch = int(batch)


def compute_steps(bench: Bench, budget_s: float) -> dict[str, Any]:
    """Memory-bound, matmul and attention throughput of this rank, all ranks at once."""
    plan, device = bench.plan, bench.device
    bench.say("memory-bound add")
    elements = MEMORY_ELEMENTS[device.type]
    left, right, out = (torch.rand(elements, device=device) for _ in range(3))
    add_s = bench.seconds_per_local_call(partial(torch.add, left, right, out=out), budget_s * SHARES["memory"])
    items = [(tuple(shape), dtype) for dtype in plan["dtypes"] for shape in plan["shapes"]]
    matmul_end = time.time() + budget_s * SHARES["matmul"] * (1 if plan["group_sizes"] else 2)
    matmul: list[list[Any]] = []
    fastest = 0.0
    for index, ((m, n, k), dtype) in enumerate(items, start=1):
        first_of_dtype = not any(point[3] == dtype for point in matmul)
        share = (matmul_end - time.time()) / (len(items) - index + 1)
        predicted = 3 * 2 * m * n * k / fastest if fastest else 0.0
        run, seconds = bench.agree(float(first_of_dtype or time.time() + predicted < matmul_end), max(share, 0.0))
        if not run:
            bench.say(f"matmul {index}/{len(items)} {m}x{n}x{k} {dtype}: skipped, the budget is spent")
            continue
        bench.say(f"matmul {index}/{len(items)} {m}x{n}x{k} {dtype}")
        operands = (torch.randn(rows, columns, device=device, dtype=getattr(torch, dtype)) for rows, columns in
                    ((m, k), (k, n)))
        per_call = bench.seconds_per_local_call(partial(torch.mm, *operands), seconds)
        matmul.append([m, n, k, dtype, 2 * m * n * k / per_call])
        fastest = max(fastest, 2 * m * n * k / per_call)
    bench.say("attention")
    attention = attention_points(bench.seconds_per_local_call, device, getattr(torch, plan["dtypes"][-1]),
                                 budget_s * SHARES["attention"])
    return {"memory_bytes_per_s": 3 * elements * 4 / add_s, "matmul": matmul,
            "attention": attention}


def overhead_round(bench: Bench, frameworks: FrameworkBench | None, budget_s: float, index: int) -> dict[str, Any]:
    """One round of the per-call overheads: an eager training operation's, and on CPU the parallel frameworks' (on
    GPU their launches overlap the kernels)."""
    bench.say(f"per-call overheads, round {index}/{ROUNDS}: an eager training operation"
              + (", FSDP units, DTensor operations, AdamW updates and pipelines" if frameworks else ""))
    measured = {"op_overhead_s": training_op_s(bench.seconds_per_local_call, budget_s * SHARES["overhead"] / ROUNDS)}
    if frameworks is not None:
        measured |= frameworks.measure(bench.seconds_per_call, bench.seconds_per_local_call,
                                       budget_s * SHARES["framework"] / ROUNDS)
    return measured


def _operation(kind: str, members: list[int], nbytes: int, bench: Bench) -> tuple[Callable[[], Any], int]:
    """The call of one collective over ``members`` on a float32 buffer of about ``nbytes``, and its exact bytes."""
    size = len(members)
    elements = max(size, nbytes // 4 // size * size)
    whole = torch.zeros(elements, device=bench.device)
    part = torch.zeros(elements // size, device=bench.device)
    out = torch.zeros(elements, device=bench.device)
    group = bench.groups[size]
    if kind == "send_recv":
        peer = members[1 - members.index(bench.rank)]

        def ping_pong() -> None:  # one round trip: two messages, halved by the caller
            first, second = (dist.send, dist.recv) if bench.rank < peer else (dist.recv, dist.send)
            first(whole, peer)
            second(whole, peer)

        return ping_pong, elements * 4
    # the newer names, where this torch has them (the older ones warn that they are deprecated)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    calls = {"all_reduce": lambda: dist.all_reduce(whole, group=group),
             "all_gather": lambda: gather(out, part, group=group),
             "reduce_scatter": lambda: scatter(part, whole, group=group),
             "all_to_all": lambda: dist.all_to_all_single(out, whole, group=group),
             "broadcast": lambda: dist.broadcast(whole, src=members[0], group=group)}
    return calls[kind], elements * 4


def _time_collective(bench: Bench, kind: str, size: int, nbytes: int, seconds: float) -> tuple[int, float] | None:
    """Median seconds of ``kind`` over this rank's group of ``size`` (None when this rank has none)."""
    members = bench.members.get(size)
    if not members:  # a rank in no group of this size still takes part in the agreement
        bench.agree(0.0)
        return None
    call, exact = _operation(kind, members, nbytes, bench)
    start_together = torch.zeros(1, device=bench.device)

    def timed() -> float:
        dist.all_reduce(start_together, group=bench.groups[size])
        bench.sync()
        begin = time.perf_counter()
        call()
        bench.sync()
        return (time.perf_counter() - begin) / (2 if kind == "send_recv" else 1)

    call()
    first = timed()
    (repetitions,) = bench.agree(min(MAX_REPETITIONS, max(MIN_REPETITIONS, int(seconds / max(first, 1e-6)))))
    return exact, statistics.median(timed() for _ in range(int(repetitions)))


def _kinds(plan: dict[str, Any]) -> list[tuple[str, int]]:
    kinds = [(kind, size) for size in sorted(plan["group_sizes"]) for kind in plan["collectives"] if kind != "send_recv"]
    return [*kinds, ("send_recv", 2)]


def _groups(bench: Bench) -> None:
    """Every group of each measured size (and of 2, for the exchanges): ranks [0, 1], [2, 3], ... of it."""
    for size in sorted(set(bench.plan["group_sizes"]) | {2}):
        for first in range(0, bench.world - size + 1, size):
            members = list(range(first, first + size))
            group = dist.new_group(members)
            if bench.rank in members:
                bench.groups[size], bench.members[size] = group, members


def collective_steps(bench: Bench, budget_s: float) -> dict[str, list[list[float]]]:
    """Each collective at each group size and message size, the required sizes first, then larger ones while the
    time lasts: ``{"kind/group_size": [[bytes, seconds], ...]}`` of this rank."""
    plan = bench.plan
    kinds = _kinds(plan)
    required = [(kind, size, nbytes) for nbytes in plan["message_bytes"] for kind, size in kinds]
    items = required + [(kind, size, nbytes) for nbytes in plan["extra_message_bytes"] for kind, size in kinds]
    end = time.time() + budget_s
    measured: dict[str, list[list[float]]] = {}
    for index, (kind, size, nbytes) in enumerate(items, start=1):
        key = f"{kind}/{size}"
        last = measured.get(key, [[1, 0.0]])[-1]
        predicted = (MIN_REPETITIONS + 2) * last[1] * nbytes / last[0]  # no faster per byte than the size before
        left = end - time.time()
        (run,) = bench.agree(float(index <= len(required) or predicted < left))
        if not run:
            continue
        bench.say(f"collective {index}/{len(items)}: {kind} over {size} ranks, {nbytes:,} bytes")
        result = _time_collective(bench, kind, size, nbytes, max(left / (len(items) - index + 1), 0.0))
        if result is not None:
            measured.setdefault(key, []).append(list(result))
    return measured


def device_name(bench: Bench) -> str:
    if bench.cuda:
        return torch.cuda.get_device_name(bench.device)
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    return f"{names[0] if names else platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def main(plan_path: str, rank: int) -> None:
    plan = json.loads(Path(plan_path).read_text())
    if plan["backend"] == "gloo" and "OMP_NUM_THREADS" not in os.environ:
        # as Lightning's `_set_num_threads_if_needed` sets each of its CPU processes (fabric/utilities/distributed.py)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan["processes"]))
    bench = Bench(plan, rank)
    dist.init_process_group(plan["backend"], store=dist.FileStore(plan["store"], bench.world), rank=rank,
                            world_size=bench.world, timeout=timedelta(seconds=plan["timeout_s"]),
                            device_id=bench.device if bench.cuda else None)
    (left,) = bench.agree(max(bench.left(), 0.0))
    frameworks = None if bench.cuda else FrameworkBench(sorted({1, *plan["group_sizes"]}), bench.world)
    rounds = [overhead_round(bench, frameworks, left, 1)]
    result = compute_steps(bench, left)
    rounds.append(overhead_round(bench, frameworks, left, 2))
    if plan["group_sizes"]:
        _groups(bench)
        result["in_step"], result["busy"] = in_step_steps(bench, _operation, _kinds(plan))
    rounds.append(overhead_round(bench, frameworks, left, 3))
    if plan["group_sizes"]:
        result["collectives"] = collective_steps(bench, bench.left())
    result |= median_overheads(rounds)
    result["device"] = device_name(bench)
    Path(plan_path).with_name(f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)  # all is written: skip the interpreter's teardown of torch, seconds on a loaded 2-core host
