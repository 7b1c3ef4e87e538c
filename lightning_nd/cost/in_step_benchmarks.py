"""How long a collective takes inside a step, where the ranks compute between calls and are never started together
again (``in_step_steps``, run by ``micro_benchmarks.py`` on every rank at once): the latency `CollectiveFit.in_step`
keeps beside the one measured with the ranks started together; and, over the same loops, how much of its wall time
each rank spent on a core (its processor time, its collectives' threads included): where the ranks outnumber the
cores, the share of the cores a step keeps busy (`HostProfile.busy_share`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

Operation = Callable[[str, list[int], int, Any], tuple[Callable[[], Any], int]]
"""``micro_benchmarks._operation``: a collective's call over a group's members at about a number of bytes."""
IN_STEP_CALLS = 20
"""Calls of each collective timed as inside a step (`_time_in_step`): the wait a call adds swings with the scheduler
(on the 2-core host, 4 ranks, a pair's all-reduce after 11.6 ms of work: 2.2-5.4 ms a call over twelve runs of 8
calls), so a mean over 8 moved the calibration's step prices by a quarter between calibrations minutes apart."""
IN_STEP_WORKING_S = 0.2
"""Processor seconds the work alone is timed for, every rank at once: long enough that the ranks share the cores as
through a step (a shorter stretch may run before the other ranks are scheduled, at a core's full speed)."""
IN_STEP_WORK_S = (0.5e-3, 6e-3)
"""Processor time each rank spends between two of those calls, as a step computes between its collectives: a
step's gaps lie between these on the 2-core host (a tensor-parallel block's, an FSDP unit's)."""


def _work(seconds: float) -> None:
    begin = time.process_time()
    while time.process_time() - begin < seconds:
        pass


def _time_in_step(bench: Any, operation: Operation, kind: str, size: int, work_s: float,
                  working_s: float) -> tuple[float, float, float] | None:
    """Seconds a small ``kind`` over this rank's group adds to a loop that works ``work_s`` of processor time
    between calls (``working_s`` per call without them) and never starts the ranks together again, as a step's
    collectives run: where the ranks outnumber the cores, a rank that waits gives its core up and the call lasts
    until the scheduler gives it back, longer the longer the others ran (on the 2-core host the tests run on, 4
    ranks: a pair's all-reduce 0.3 ms started together, 2-5 ms in such a loop). A ``send_recv`` is one exchange,
    each rank sending to its peer and receiving from it at once, as a pipeline's and a ring's exchanges are. Returns
    that time per call, and the loop's processor and wall seconds on this rank."""
    members = bench.members.get(size)
    if not members:
        return None
    if kind == "send_recv":
        peer = members[1 - members.index(bench.rank)]
        outgoing, incoming = torch.zeros(64, device=bench.device), torch.zeros(64, device=bench.device)

        def call() -> None:
            for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, peer),
                                                   dist.P2POp(dist.irecv, incoming, peer)]):
                request.wait()
    else:
        call, _ = operation(kind, members, 256, bench)
    call()
    dist.barrier(group=bench.groups[size])
    begin, processor = time.perf_counter(), time.process_time()
    for _ in range(IN_STEP_CALLS):
        _work(work_s)
        call()
    bench.sync()
    wall = time.perf_counter() - begin
    return max(wall / IN_STEP_CALLS - working_s, 1e-9), time.process_time() - processor, wall


def in_step_steps(bench: Any, operation: Operation,
                  kinds: list[tuple[str, int]]) -> tuple[dict[str, list[list[float]]], list[list[float]]]:
    """Each collective's ``_time_in_step`` at each group size after each of ``IN_STEP_WORK_S``: ``{"kind/group_size":
    [[seconds of work between calls, seconds per call], ...]}`` of this rank, the work as long as it took here; and
    per amount of work, ``[seconds of work between calls, processor seconds, wall seconds]`` of this rank's loops."""
    measured: dict[str, list[list[float]]] = {}
    busy: list[list[float]] = []
    for work_s in IN_STEP_WORK_S:
        dist.barrier()
        repetitions = max(IN_STEP_CALLS, round(IN_STEP_WORKING_S / work_s))
        begin = time.perf_counter()
        for _ in range(repetitions):
            _work(work_s)
        (working_s,) = bench.agree((time.perf_counter() - begin) / repetitions)
        busy.append([working_s, 0.0, 0.0])
        for kind, size in kinds:
            bench.say(f"{kind} over {size} ranks, inside a step ({working_s * 1e3:.1f} ms of work between calls)")
            timed = _time_in_step(bench, operation, kind, size, work_s, working_s)
            if timed is not None:
                measured.setdefault(f"{kind}/{size}", []).append([working_s, timed[0]])
                busy[-1][1] += timed[1]
                busy[-1][2] += timed[2]
    return measured, busy
