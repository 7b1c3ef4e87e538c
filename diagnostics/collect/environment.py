"""The variables `CollectiveMonitor` sets in each rank's environment before the process group starts: NCCL's
INFO log into one file per rank, the flight recorder's buffer and (on NCCL) its dump on timeout, and optionally
``TORCH_DISTRIBUTED_DEBUG``. A variable the user set is kept, and said so."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from pathlib import Path

FR_BUFFER_ENTRIES = "2000"
NCCL_SUBSYSTEMS = "INIT,ENV,NET,GRAPH"  # init, the variables in effect, transports, rings/trees


def wanted_environment(backend: str, rank: int, folder: Path, buffer_entries: int | None = None,
                       distributed_debug: str | None = None) -> dict[str, str]:
    """What this rank should have; ``folder`` is the run's diagnostics dir (the same on every rank)."""
    wanted = {"TORCH_FR_BUFFER_SIZE": str(buffer_entries) if buffer_entries is not None else FR_BUFFER_ENTRIES}
    if "nccl" in backend:
        wanted.update({
            "NCCL_DEBUG": "INFO",
            "NCCL_DEBUG_SUBSYS": NCCL_SUBSYSTEMS,
            "NCCL_DEBUG_FILE": str(folder / "nccl" / f"nccl.rank{rank}.%h.%p.log"),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_ENABLE_TIMING": "1",
            # torch appends the rank: fr/fr_rank_<R>, the same names as our own dumps on gloo
            "TORCH_FR_DUMP_TEMP_FILE": str(folder / "fr" / "fr_rank_"),
            "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(folder / "fr" / "pipe_rank_"),
        })
    if distributed_debug is not None:
        wanted["TORCH_DISTRIBUTED_DEBUG"] = distributed_debug
    return wanted


def apply_environment(wanted: Mapping[str, str],
                      environ: MutableMapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Set what is not set; returns (set, kept): the user's own values are never overwritten."""
    applied, kept = {}, {}
    for name, value in wanted.items():
        if name in environ:
            if environ[name] != value:
                kept[name] = environ[name]
            continue
        environ[name] = value
        applied[name] = value
    return applied, kept
