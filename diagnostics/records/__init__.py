"""What the probes record, as frozen dataclasses with one JSON codec: the contract between the live monitors, the files
a run leaves (``<log_dir>/diagnostics/``), ``tests/data`` and the offline CLI (``python -m diagnostics``). One module
per concept: `collectives` (flight-recorder entries, the point-to-point ledger, a failed rank's capture, the hang
verdict), `nccl` (what an NCCL log says), `memory` (the out-of-memory report), `bottleneck` (a window's phases per
rank, its context and diagnosis), `routing` (an interval's tokens per expert per MoE layer and its verdict), `run`
(how a run ended and what it measured, for a sweep's comparison); `codec` writes and reads them all, `files` names
their files. Nothing here imports torch, Lightning or `lightning_nd`: a record read back from disk is the same object
the probe made.
"""

from __future__ import annotations

from diagnostics.records.bottleneck import LABELS, PHASES, Diagnosis, RankTimes, WindowContext, WindowRecord
from diagnostics.records.codec import from_dict, from_json, to_dict, to_json
from diagnostics.records.collectives import (
    CollectiveEntry,
    Culprit,
    Frame,
    GroupRecord,
    HangReport,
    PointToPointRecord,
    RankCapture,
)
from diagnostics.records.files import (
    BOTTLENECK_FILE,
    CAPTURE_FILE,
    HANG_FILE,
    MEMORY_FILE,
    ROUTING_FILE,
    read_captures,
    read_intervals,
    read_windows,
    write_atomic,
)
from diagnostics.records.memory import KINDS, Advice, MemoryFigure, MemoryReport, OomMessage
from diagnostics.records.nccl import Connection, NcclComm, NcclRankLog
from diagnostics.records.routing import CollapsedExpert, DeadExperts, LayerRouting, RoutingInterval, RoutingVerdict
from diagnostics.records.run import RUN_FILE, STATUSES, FoundRun, RunRecord, find_runs

__all__ = [
    "BOTTLENECK_FILE", "CAPTURE_FILE", "HANG_FILE", "KINDS", "LABELS", "MEMORY_FILE", "PHASES", "ROUTING_FILE",
    "RUN_FILE", "STATUSES", "Advice", "CollapsedExpert", "CollectiveEntry", "Connection", "Culprit", "DeadExperts",
    "Diagnosis", "FoundRun", "Frame", "GroupRecord", "HangReport", "LayerRouting", "MemoryFigure", "MemoryReport",
    "NcclComm", "NcclRankLog", "OomMessage", "PointToPointRecord", "RankCapture", "RankTimes", "RoutingInterval",
    "RoutingVerdict", "RunRecord", "WindowContext", "WindowRecord", "find_runs", "from_dict", "from_json",
    "read_captures", "read_intervals", "read_windows", "to_dict", "to_json", "write_atomic",
]
