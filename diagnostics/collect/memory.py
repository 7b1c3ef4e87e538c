"""What a rank holds, measured: model state from the live module and optimizer, the process from ``/proc``, the
device from the CUDA caching allocator, and its allocation history when someone is recording it."""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

STATUS = Path("/proc/self/status")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (what its memory holds), a plain tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]]) -> int:
    """Bytes of the storages behind ``tensors``, each once: tied weights, views and shards of one flat buffer share
    a storage, and padding of a shard's storage is memory too."""
    total = 0
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        key = (str(storage.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def model_state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """``params``, ``grads``, ``optimizer`` and ``optimizer_steps``: bytes of this rank's local shards.

    ``optimizer`` counts every tensor in ``optimizer.state`` with at least one dimension (Adam's moments);
    the 0-dim step counters go to ``optimizer_steps``, apart, since no cost model counts them and on a device they
    are one small allocation each. A storage counted once is not counted again under a later key.

    The parameters are the optimizer's when there is one: while FSDP holds a unit gathered (mid-forward, where an
    out-of-memory error strikes) the module shows the unsharded tensors, and the optimizer still the shards.
    """
    seen: set[tuple[str, int]] = set()
    params = ([p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None
              else list(module.parameters()))
    state = [value for per_param in (optimizer.state.values() if optimizer else ()) for value in per_param.values()
             if isinstance(value, torch.Tensor)]
    return {
        "params": _storage_bytes(params, seen),
        "grads": _storage_bytes([p.grad for p in params if p.grad is not None], seen),
        "optimizer": _storage_bytes([t for t in state if _local(t).dim() > 0], seen),
        "optimizer_steps": _storage_bytes([t for t in state if _local(t).dim() == 0], seen),
    }


def process_memory() -> dict[str, int | None]:
    """``rss_bytes`` and ``peak_rss_bytes`` (VmRSS, VmHWM) of this process; None where there is no ``/proc``."""
    fields = {"VmRSS": "rss_bytes", "VmHWM": "peak_rss_bytes"}
    values: dict[str, int | None] = dict.fromkeys(fields.values())
    try:
        lines = STATUS.read_text().splitlines()
    except OSError:
        return values
    for line in lines:
        name, _, rest = line.partition(":")
        if name in fields:
            number, *unit = rest.split()
            values[fields[name]] = int(number) * (1024 if unit == ["kB"] else 1)
    return values


def cuda_memory(device: torch.device | int | None = None) -> dict[str, int] | None:
    """The caching allocator's view of ``device`` (None without CUDA): ``allocated``, ``reserved``,
    ``peak_allocated``, ``peak_reserved``, and the driver's ``capacity`` and ``free``.

    ``non_pytorch`` = (capacity - free) - reserved: the CUDA context, NCCL's buffers, cuBLAS workspaces, and any
    other process on the same device, which ``mem_get_info`` cannot tell apart.
    """
    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.memory_stats(device)
    free, capacity = torch.cuda.mem_get_info(device)
    reserved = stats.get("reserved_bytes.all.current", 0)
    return {
        "allocated": stats.get("allocated_bytes.all.current", 0),
        "reserved": reserved,
        "peak_allocated": stats.get("allocated_bytes.all.peak", 0),
        "peak_reserved": stats.get("reserved_bytes.all.peak", 0),
        "capacity": capacity,
        "free": free,
        "non_pytorch": capacity - free - reserved,
    }


def snapshot_if_recording(path: Path) -> bool:
    """Write the allocator's snapshot (the ``pytorch.org/memory_viz`` pickle) to ``path`` when someone records
    CUDA memory history (``torch.cuda.memory._record_memory_history``); False on CPU or when nobody records.

    One ``_snapshot()`` and the same pickle ``_dump_snapshot`` writes: torch has no public "is recording" call,
    and a snapshot without history (empty ``device_traces``) says nothing about how the peak was reached.
    """
    if not torch.cuda.is_available():
        return False
    snapshot = torch.cuda.memory._snapshot()
    if not any(snapshot.get("device_traces", ())):
        return False
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(pickle.dumps(snapshot))
    temporary.replace(path)
    return True


__all__ = ["cuda_memory", "model_state_bytes", "process_memory", "snapshot_if_recording"]
