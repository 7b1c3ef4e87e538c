"""Measure this host into a `HostProfile`: ``calibrate(world_sizes=(2, 4), processes=4, budget_s=30)``, or
``host_profile()`` for the cached one (measured and cached on first use).

It starts ``processes`` Python processes at once (``micro_benchmarks.py``), joined in a process group of the real
backend (gloo on CPU, NCCL on GPU) through a `FileStore` in a temporary folder, so every number is one process's
while the others run too, as under a layout: the eager overhead of a tiny op, the throughput of a memory-bound add,
of each matmul shape in each dtype, and each collective's time at several message sizes for every group size
asked, from which latency and bandwidth are fitted (`profile.CollectiveFit.fit`). Each number is the median over
the processes. The whole run keeps to ``budget_s``: starting the processes takes its share (about 4 s for 4 on 2
CPU cores), the steps share the rest, a matmul shape or a larger message size that would not fit is left out, and
every collective is measured at its three required sizes whatever is left.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

import torch

from lightning_nd.cost.framework_benchmarks import median_overheads
from lightning_nd.cost.profile import (
    COLLECTIVES,
    RECALIBRATE,
    AttentionPoint,
    CollectiveFit,
    FrameworkPoint,
    HostProfile,
    MatmulPoint,
    cache_path,
    cached_profile,
    default_backend,
)

CPU_PROCESSES = 4
"""Processes measured with on a host without GPUs: as many as the project's CPU runs start."""
SHAPES = {"gloo": [(64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024)],
          "nccl": [(256, 256, 256), (1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192)]}
MESSAGE_BYTES = {"gloo": ([2**12, 2**18, 2**22], [2**24]), "nccl": ([2**16, 2**22, 2**26], [2**28, 2**30])}
"""Per backend: the three sizes every collective is measured at, then the larger ones measured while time is left."""
RESERVE_S = 3.0
"""Of the budget, kept for the last step to end, the processes to exit and the profile to be assembled."""
GRACE_S = 60.0
"""How long past the budget the processes may run before they are stopped and the calibration fails."""
BUSY_FLOOR = 0.85
"""The least share of the cores the processes keep busy after the longest work between calls on an idle host: the
2-core host's idle calibrations measured 94-96% with 4 processes, one beside a test run 71% (and priced the example
Llama's layouts at 1.26-2.07x their steps)."""


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def default_processes() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else CPU_PROCESSES


def default_group_sizes(processes: int) -> list[int]:
    """Every group size a layout of ``processes`` ranks on this host can make: the divisors above 1."""
    return [size for size in range(2, processes + 1) if processes % size == 0]


def calibrate(world_sizes: Sequence[int] | None = None, shapes: Sequence[tuple[int, int, int]] | None = None,
              dtypes: Sequence[str] = ("float32",), processes: int | None = None, budget_s: float = 30.0,
              progress: Callable[[str], None] = to_stderr) -> HostProfile:
    """Measure this host with ``processes`` processes at once (default: its GPUs, else 4) in at most ``budget_s``
    seconds: matmuls at ``shapes`` (m, n, k) in ``dtypes``, and the collectives over groups of each of
    ``world_sizes`` ranks (default: every divisor of ``processes`` above 1; a size of 1 has no collective)."""
    backend = default_backend()
    processes = default_processes() if processes is None else processes
    group_sizes = sorted({s for s in (default_group_sizes(processes) if world_sizes is None else world_sizes) if s > 1})
    _check(backend, processes, group_sizes, shapes, dtypes, budget_s)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lightning_nd_calibrate_") as folder:
        plan = {"processes": processes, "backend": backend, "store": str(Path(folder) / "store"),
                "deadline": time.time() + budget_s - RESERVE_S, "timeout_s": budget_s + GRACE_S,
                "shapes": [list(s) for s in (shapes or SHAPES[backend])], "dtypes": list(dtypes),
                "group_sizes": group_sizes, "collectives": list(COLLECTIVES),
                "message_bytes": MESSAGE_BYTES[backend][0], "extra_message_bytes": MESSAGE_BYTES[backend][1]}
        plan_path = Path(folder) / "plan.json"
        plan_path.write_text(json.dumps(plan))
        progress(f"calibrating: starting {processes} processes ({backend}), at most {budget_s:g} s")
        busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        if busy > (os.cpu_count() or 1):
            progress(f"calibrating: this host is busy (load average {busy:.1f} on {os.cpu_count()} cores): what"
                     " it measures is slower than the host alone; measure it again when it is idle")
        results = _run(plan_path, processes, budget_s + GRACE_S, progress)
    profile = _profile(results, backend, processes, time.perf_counter() - start)
    if (warning := busy_warning(profile)) is not None:
        progress(f"calibrating: {warning}")
    return profile


def busy_warning(profile: HostProfile) -> str | None:
    """What to say when the ranks kept the cores less busy than an idle host does after the longest work between
    calls (`HostProfile.busy_share`): another process took cores from them, and every price is too high."""
    if not profile.oversubscribed or not profile.utilization:
        return None
    work, share = profile.utilization[-1]
    if share >= BUSY_FLOOR:
        return None
    return (f"the {profile.processes} processes kept only {share:.0%} of the {profile.cores} cores busy after"
            f" {work * 1e3:.1f} ms of work between calls (an idle host: {BUSY_FLOOR:.0%} or more): another process"
            " probably ran beside the calibration, and every layout is priced too slow. Measure again when the host"
            f" is idle: `{RECALIBRATE} --refresh-profile`")


def host_profile(*, refresh: bool = False, processes: int | None = None, dtypes: Sequence[str] | None = None,
                 budget_s: float = 30.0, progress: Callable[[str], None] = to_stderr) -> tuple[HostProfile, Path]:
    """This host's cached profile and its file; measured and cached first when there is none, it was measured by
    another host, torch or backend or with another number of ``processes`` at once (when given: 4 processes share
    2 cores unlike 2 do), or ``refresh``. Default dtypes: float32, and bfloat16 on GPU."""
    backend = default_backend()
    path = cache_path(backend)
    profile = None if refresh else cached_profile(backend)
    if profile is not None and processes is not None and profile.processes != processes:
        progress(f"the cached profile {path} was measured with {profile.processes} processes at once, this layout"
                 f" starts {processes}: measuring again")
        profile = None
    if profile is None:
        dtypes = dtypes or (("float32", "bfloat16") if backend == "nccl" else ("float32",))
        profile = calibrate(None, None, dtypes, processes, budget_s, progress)
        profile.save(path)
    return profile, path


def _check(backend: str, processes: int, group_sizes: list[int], shapes: Sequence[tuple[int, int, int]] | None,
           dtypes: Sequence[str], budget_s: float) -> None:
    if processes < 1:
        raise ValueError(f"`calibrate(processes={processes})` runs no process. HINT: pass `processes=1` or more.")
    if backend == "nccl" and processes > torch.cuda.device_count():
        raise ValueError(f"`calibrate(processes={processes})` needs a GPU per process, this host has"
                         f" {torch.cuda.device_count()}. HINT: pass `processes={torch.cuda.device_count()}` or fewer.")
    if group_sizes and group_sizes[-1] > processes:
        raise ValueError(f"`calibrate(world_sizes={group_sizes})` asks for groups larger than its {processes}"
                         f" processes. HINT: pass `processes={group_sizes[-1]}` or smaller world sizes.")
    if shapes is not None and not all(len(shape) == 3 and min(shape) > 0 for shape in shapes):
        raise ValueError(f"`calibrate(shapes={list(shapes)})`: each shape is (m, n, k), all positive. HINT: e.g."
                         " `shapes=[(1024, 1024, 1024)]`.")
    unknown = [dtype for dtype in dtypes if not isinstance(getattr(torch, dtype, None), torch.dtype)]
    if unknown or not dtypes:
        raise ValueError(f"`calibrate(dtypes={tuple(dtypes)})`: {unknown or 'none'} not torch dtypes. HINT: e.g."
                         " `dtypes=('float32', 'bfloat16')`.")
    if budget_s <= RESERVE_S:
        raise ValueError(f"`calibrate(budget_s={budget_s})` leaves no time to measure. HINT: give it at least"
                         " 5 s (30 s measures everything on a 2-core CPU with 4 processes).")


def _run(plan_path: Path, processes: int, timeout_s: float, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Start every rank, forward rank 0's progress lines, wait; each rank's measurements."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))}
    folder = plan_path.parent
    with ExitStack() as logs:
        workers = [subprocess.Popen(
            [sys.executable, "-m", "lightning_nd.cost.micro_benchmarks", str(plan_path), str(rank)], env=environment,
            stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, text=True,
            stderr=logs.enter_context(open(folder / f"rank{rank}.log", "w"))) for rank in range(processes)]
        forward = threading.Thread(target=_forward, args=(workers[0].stdout, progress), daemon=True)
        forward.start()
        deadline = time.monotonic() + timeout_s
        try:  # until all end, one fails (the others would wait for it in a collective) or the time is up
            while any(w.poll() is None for w in workers) and not any(w.returncode for w in workers):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"The calibration ran {GRACE_S:g} s past its budget and was stopped. HINT: a"
                                       f" rank may have hung; rank 0's log:\n{_tail(folder, 0)}")
                time.sleep(0.05)
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
            forward.join(timeout=5)
    failed = sorted((rank for rank, worker in enumerate(workers) if worker.returncode),
                    key=lambda rank: workers[rank].returncode < 0)  # a rank that failed before those stopped here
    if failed:
        raise RuntimeError(f"Calibration process {failed[0]} failed; its log:\n{_tail(folder, failed[0])}")
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(processes)]


def _forward(stream: IO[str], progress: Callable[[str], None]) -> None:
    for line in stream:
        progress(line.rstrip("\n"))


def _tail(folder: Path, rank: int) -> str:
    return (folder / f"rank{rank}.log").read_text()[-3000:]


def _profile(results: list[dict[str, Any]], backend: str, processes: int, seconds: float) -> HostProfile:
    """One profile from every rank's measurements: the median over the ranks of each."""
    matmul = [MatmulPoint(m, n, k, dtype, statistics.median(r["matmul"][i][4] for r in results))
              for i, (m, n, k, dtype, _) in enumerate(results[0]["matmul"])]
    collectives = []
    for key in results[0].get("collectives", {}):
        kind, _, size = key.partition("/")
        times: dict[int, list[float]] = {}
        for rank in results:
            for nbytes, elapsed in rank["collectives"].get(key, []):
                times.setdefault(int(nbytes), []).append(elapsed)
        in_step = [rank["in_step"][key] for rank in results if key in rank.get("in_step", {})]
        points = [(statistics.median(p[i][0] for p in in_step), statistics.median(p[i][1] for p in in_step))
                  for i in range(min(map(len, in_step)))] if in_step else []
        collectives.append(CollectiveFit.fit(kind, int(size), [(b, statistics.median(t)) for b, t in times.items()],
                                             points))
    overheads = median_overheads(results)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return HostProfile(
        host=socket.gethostname(), torch=torch.__version__, backend=backend, device=results[0]["device"],
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"), calibration_s=round(seconds, 2),
        processes=processes, matmul=tuple(matmul),
        memory_bytes_per_s=statistics.median(r["memory_bytes_per_s"] for r in results),
        op_overhead_s=overheads["op_overhead_s"], collectives=tuple(collectives),
        framework=tuple(FrameworkPoint(int(point[0]), *point[1:]) for point in overheads.get("framework", [])),
        adam_tensor_s=overheads.get("adam_tensor_s"),
        attention=tuple(AttentionPoint(*map(int, point[:3]), statistics.median(r["attention"][i][3] for r in results))
                        for i, point in enumerate(results[0].get("attention", []))),
        cores=cores, utilization=_utilization(results, min(cores, processes)))


def _utilization(results: list[dict[str, Any]], cores: int) -> tuple[tuple[float, float], ...]:
    """Per amount of work between collective calls, the ranks' processor seconds over ``cores`` x their mean wall
    seconds through the same loops (at most 1)."""
    loops = [r["busy"] for r in results if r.get("busy")]
    if len(loops) < len(results) or not loops:
        return ()
    return tuple((statistics.median(r[i][0] for r in loops),
                  min(1.0, sum(r[i][1] for r in loops) / cores / statistics.mean(r[i][2] for r in loops)))
                 for i in range(min(map(len, loops))) if all(r[i][2] > 0 and r[i][1] > 0 for r in loops))
