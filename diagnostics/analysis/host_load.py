"""Whether the ranks of a window share their host's processors: more processes on a host than the CPU cores they
may run on, or GPUs used by more than one rank. Then every phase is stretched by time-slicing and every rank waits
for the others inside collectives, whatever the layout: the window's times say more about the host than about the
model, and the usual advice (bf16, compile, another layout) does not apply.

Pure: over a window's `WindowContext` (hosts per rank, cores per host, shared GPUs), as recorded.
"""

from __future__ import annotations

from collections import Counter

from diagnostics.records import WindowContext


def oversubscribed(context: WindowContext) -> tuple[str, ...]:
    """One sentence per shared host or GPU (empty when every process has its own), in host order."""
    found = []
    for host, processes in sorted(Counter(context.hosts.values()).items()):
        cores = context.host_cores.get(host)
        if cores and processes > cores:
            found.append(f"host {host} runs {processes} processes on {cores} CPU core{'s' if cores > 1 else ''}:"
                         f" each gets {cores / processes:.2g} of a core, so compute is time-sliced and ranks wait for"
                         " one another inside every collective")
    for gpu, ranks in sorted(context.shared_gpus.items()):
        found.append(f"ranks {', '.join(map(str, ranks))} share one GPU ({gpu}): their kernels queue on it")
    return tuple(found)


def host_advice(context: WindowContext) -> str:
    """What to do about `oversubscribed` (the advice's first line when it holds)."""
    cores = min((context.host_cores[host] for host in set(context.hosts.values()) if host in context.host_cores),
                default=None)
    fit = f", at most {cores} here" if cores else ""
    return (f"give each process its own core or GPU: fewer processes per host (trainer.devices{fit}), or more hosts;"
            " until then these times measure the shared host, not the layout: a demo's numbers, not a speed to"
            " tune with bf16, compile or another layout")
