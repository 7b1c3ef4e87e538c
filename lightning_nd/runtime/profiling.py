"""Labels in `torch.profiler` traces, so a trace of an `NDParallel` step says which phase each op ran in and which
mesh role each collective of ours served (gloo's events name no process group).

Only while a profiler records (a check of about 0.2 us otherwise). The names are the contract with
`diagnostics.analysis.trace`:

- ``nd::phase::<name>``: forward, backward, optimizer (the strategy's `StepEvents` phases); under pp each
  microbatch's forward / backward / backward_weight, inside ``nd::pipeline`` (the schedule's whole run, so its
  time outside the microbatches is the stage waiting for its neighbours);
- ``nd::comm::<role>::<op>``: a collective or point-to-point operation of this project's own code (ring
  attention's hops over cp, the MoE all-to-all over ep, the loss reduction, the clipping norm, tied weights over
  pp), ``role`` a mesh role of `lightning_nd.mesh.roles`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch.autograd.profiler import record_function

PHASE = "nd::phase::"
COMM = "nd::comm::"
PIPELINE = "nd::pipeline"


def recording() -> bool:
    return torch._C._autograd._profiler_enabled()


def label(name: str) -> Any:
    """A `record_function` named ``name`` while a profiler records, else nothing (nor inside a block
    `torch.compile` traces: the check would break its graph)."""
    return record_function(name) if not torch.compiler.is_compiling() and recording() else nullcontext()


def phase_label(name: str) -> Any:
    return label(PHASE + name)


def comm_label(role: str, op: str) -> Any:
    return label(f"{COMM}{role}::{op}")
