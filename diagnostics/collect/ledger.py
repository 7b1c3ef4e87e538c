"""Each rank's ledger of point-to-point operations (the pipeline's and ring attention's sends and receives), the
part of the communication the flight recorder misses on gloo. Bounded: the newest ``capacity`` records."""

from __future__ import annotations

from collections import deque

from diagnostics.records import PointToPointRecord


class PointToPointLedger:
    def __init__(self, capacity: int = 4096) -> None:
        self._records: deque[PointToPointRecord] = deque(maxlen=capacity)

    def add(self, op: str, peer: int, role: str, state: str, step: int, tag: str, size: int, time_s: float) -> None:
        self._records.append(PointToPointRecord(op, peer, role, state, step, tag, size, time_s))

    def records(self) -> tuple[PointToPointRecord, ...]:
        return tuple(self._records)
