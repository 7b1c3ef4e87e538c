"""A `HostProfile` with round numbers, for the tests that read profiles without measuring one."""

from __future__ import annotations

import dataclasses
import socket
from typing import Any

import torch

from lightning_nd.cost.profile import COLLECTIVES, CollectiveFit, FrameworkPoint, HostProfile, MatmulPoint

LATENCY_S, BYTES_PER_S = 50e-6, 2e9
MESSAGE_BYTES = (2**12, 2**18, 2**22)


def synthetic_profile(**changes: Any) -> HostProfile:
    """This process's host, torch and gloo; matmuls at 1, 10 and 50 GFLOP/s; every collective over 2 and 8 ranks at
    `LATENCY_S` x ranks / 2 + bytes / `BYTES_PER_S`."""
    collectives = tuple(
        CollectiveFit.fit(kind, size, [(n, size / 2 * LATENCY_S + n / BYTES_PER_S) for n in MESSAGE_BYTES])
        for size in (2, 8) for kind in COLLECTIVES)
    profile = HostProfile(
        host=socket.gethostname(), torch=torch.__version__, backend="gloo", device="a test CPU, 1 threads",
        created="2025-01-01T00:00:00+00:00", calibration_s=12.5, processes=8,
        matmul=(MatmulPoint(64, 64, 64, "float32", 1e9), MatmulPoint(256, 256, 256, "float32", 1e10),
                MatmulPoint(1024, 1024, 1024, "float32", 5e10)),
        memory_bytes_per_s=5e9, op_overhead_s=3e-6, collectives=collectives,
        framework=(FrameworkPoint(1, 5e-4, 1e-4, 1e-4, 3e-4), FrameworkPoint(2, 1e-3, 1.5e-4, 1.2e-4, 2e-3),
                   FrameworkPoint(8, 2e-3, 2e-4, 1.5e-4, 4e-3)), adam_tensor_s=5e-5)
    return dataclasses.replace(profile, **changes)
