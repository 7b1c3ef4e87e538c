"""Forward-only pipelining for validation, test and predict: each microbatch walks the stages in
order with blocking point-to-point sends. No overlap between microbatches, but no schedule state
either: it works for every stage-to-rank mapping (torch's ``eval`` of the V-shaped schedules still
runs their backward actions, which fail without a backward).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
HEADER = 9  # dtype, ndim, up to 7 sizes


Report = Callable[[str, dict[str, Any]], None]


def _noted(report: Report | None, op: str, peer: int, tensor: torch.Tensor, state: str) -> None:
    if report is not None:
        report("p2p", {"op": op, "peer": peer, "bytes": tensor.numel() * tensor.element_size(), "state": state,
                       "time_s": time.perf_counter(), "direction": "eval"})


def _send(tensor: torch.Tensor, dst: int, report: Report | None = None) -> None:
    if tensor.dtype not in DTYPES or tensor.ndim > HEADER - 2:
        raise TypeError(f"A pipeline stage handed on a {tensor.dtype} tensor of {tensor.ndim} dims; stages may pass"
                        f" tensors of {', '.join(map(str, DTYPES))} with up to {HEADER - 2} dims."
                        " HINT: return the hidden states as one such tensor from each block.")
    header = torch.zeros(HEADER, dtype=torch.long, device=tensor.device)
    header[0], header[1] = DTYPES.index(tensor.dtype), tensor.ndim
    header[2:2 + tensor.ndim] = torch.tensor(tensor.shape)
    dist.send(header, dst)
    _noted(report, "send", dst, tensor, "issued")
    dist.send(tensor.contiguous(), dst)
    _noted(report, "send", dst, tensor, "completed")


def _recv(src: int, device: torch.device, report: Report | None = None) -> torch.Tensor:
    header = torch.empty(HEADER, dtype=torch.long, device=device)
    dist.recv(header, src)
    shape = header[2:2 + int(header[1])].tolist()
    tensor = torch.empty(shape, dtype=DTYPES[int(header[0])], device=device)
    _noted(report, "recv", src, tensor, "issued")
    dist.recv(tensor, src)
    _noted(report, "recv", src, tensor, "completed")
    return tensor


def chunk(values: Mapping[str, Any], count: int) -> list[dict[str, Any]]:
    """Split every tensor along dim 0 into ``count`` microbatches; other values go to each one."""
    parts = {k: torch.tensor_split(v, count) if isinstance(v, torch.Tensor) else [v] * count for k, v in values.items()}
    return [{k: parts[k][i] for k in values} for i in range(count)]


@torch.no_grad()
def forward_only(
    modules: Mapping[int, nn.Module],
    owners: Sequence[int],
    inputs: Mapping[str, Any],
    microbatches: int,
    device: torch.device,
    finish: Callable[[torch.Tensor, int], None],
    report: Report | None = None,
) -> None:
    """Run ``inputs`` through every stage. ``modules``: this rank's stages by index; ``owners``: the
    global rank of each stage. ``finish(output, microbatch)`` is called with each last-stage output."""
    rank, last = dist.get_rank(), len(owners) - 1
    for index, kwargs in enumerate(chunk(inputs, microbatches)):
        carried: torch.Tensor | None = None
        for stage, owner in enumerate(owners):
            if owner != rank:
                continue
            if stage > 0 and owners[stage - 1] != rank:
                carried = _recv(owners[stage - 1], device, report)
            carried = modules[stage](*([] if stage == 0 else [carried]), **kwargs)
            if stage == last:
                finish(carried, index)
            elif owners[stage + 1] != rank:
                _send(carried, owners[stage + 1], report)
