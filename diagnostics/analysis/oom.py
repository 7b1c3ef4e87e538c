"""An out-of-memory message, parsed: torch's CUDA (and ROCm) caching allocator and its CPU allocator.

The wordings, from ``c10/cuda/CUDACachingAllocator.cpp`` and ``c10/core/impl/alloc_cpu.cpp`` (samples and their
sources in ``tests/data/oom/SOURCES.md``):

- torch >= 2.1: ``CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which
  1.23 GiB is free. [Process 123 has 1.00 GiB memory in use. ]Including non-PyTorch memory, this process has
  77.90 GiB memory in use. [X allowed; ]Of the allocated memory 75.10 GiB is allocated by PyTorch, [with X allocated
  in private pools (e.g., CUDA Graphs), ]and 1.30 GiB is reserved by PyTorch but unallocated. ...``
  (2.1 spells it ``capacty``; without NVML the process sentences are missing.)
- later torch 1.x to 2.0: ``CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.24 GiB
  already allocated; 3.12 MiB free; [X allowed; ]14.53 GiB reserved in total by PyTorch)``.
- early torch 1.x: ``... 3.12 MiB free; 4.68 MiB cached)``, where ``cached`` is the reserved-but-unallocated part.
- CPU: ``DefaultCPUAllocator: can't allocate memory: you tried to allocate 1125899906842624 bytes. Error code 12
  (Cannot allocate memory)``; Windows and Android: ``DefaultCPUAllocator: not enough memory: you tried to allocate
  N bytes.``

Sizes are torch's ``format_size``: ``N bytes`` up to 1 KiB, then KiB, MiB, GiB with two decimals (1024-based), so a
parsed size is within half a unit of the last decimal of what the allocator saw.
"""

from __future__ import annotations

import re

from diagnostics.records import OomMessage

UNITS = {"bytes": 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
TEXT_LIMIT = 500
_SIZE = r"(\d+(?:\.\d+)?) (bytes|B|KiB|MiB|GiB|TiB)\b"

_GPU_OOM = re.compile(r"\b(?:CUDA|HIP) out of memory\b")
_CPU_OOM = re.compile(r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)")
_GPU_INDEX = re.compile(r"\bGPU (\d+)\b")
_REQUESTED = re.compile(r"Tried to allocate " + _SIZE)
_CPU_REQUESTED = re.compile(r"you tried to allocate (\d+) bytes")
_CAPACITY = (re.compile(r"total capac(?:i)?ty of " + _SIZE), re.compile(_SIZE + r" total capacity"))
_FREE = (re.compile(r"of which " + _SIZE + r" is free"), re.compile(_SIZE + r" free;"))
_THIS_PROCESS = re.compile(r"this process has " + _SIZE + r" memory in use")
_OTHER_PROCESS = re.compile(r"Process (\d+) has " + _SIZE + r" memory in use")
_ALLOWED = re.compile(_SIZE + r" allowed;")
_ALLOCATED = (re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch"),
              re.compile(_SIZE + r" already allocated"))
_UNALLOCATED = (re.compile(_SIZE + r" is reserved by PyTorch but unallocated"), re.compile(_SIZE + r" cached\)"))
_RESERVED_TOTAL = re.compile(_SIZE + r" reserved in total by PyTorch")


def size_bytes(number: str, unit: str) -> int:
    """``("2.00", "GiB")`` -> 2147483648."""
    return round(float(number) * UNITS[unit])


def _first(patterns: tuple[re.Pattern, ...], line: str) -> int | None:
    for pattern in patterns:
        if match := pattern.search(line):
            return size_bytes(*match.groups())
    return None


def _oom_line(text: str) -> tuple[str | None, str]:
    """The line that holds the message (a traceback ends with it) or None, and the line to keep as ``text``: that
    one, else the first line with anything on it."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    found = next((line for line in lines if _GPU_OOM.search(line) or _CPU_OOM.search(line)), None)
    return found, (found or (lines[0] if lines else ""))[:TEXT_LIMIT]


def parse_oom(text: str) -> OomMessage:
    """The numbers an OOM message holds; text that is no known OOM message gives an ``OomMessage`` with only
    ``text`` set. Parsed from the whole line, not the 500 characters kept in ``text``."""
    full, kept = _oom_line(text)
    if full is None:
        return OomMessage(text=kept)
    if _CPU_OOM.search(full):
        requested = _CPU_REQUESTED.search(full)
        return OomMessage(device="cpu", requested_bytes=int(requested.group(1)) if requested else None, text=kept)
    index = _GPU_INDEX.search(full)
    requested = _REQUESTED.search(full)
    allocated = _first(_ALLOCATED, full)
    unallocated = _first(_UNALLOCATED, full)
    reserved_total = _RESERVED_TOTAL.search(full)
    if unallocated is None and reserved_total and allocated is not None:
        unallocated = size_bytes(*reserved_total.groups()) - allocated
    in_use = _THIS_PROCESS.search(full)
    allowed = _ALLOWED.search(full)
    return OomMessage(
        device=f"cuda:{index.group(1)}" if index else "cuda",
        requested_bytes=size_bytes(*requested.groups()) if requested else None,
        capacity_bytes=_first(_CAPACITY, full),
        free_bytes=_first(_FREE, full),
        process_in_use_bytes=size_bytes(*in_use.groups()) if in_use else None,
        allocated_bytes=allocated,
        reserved_unallocated_bytes=unallocated,
        allowed_bytes=size_bytes(*allowed.groups()) if allowed else None,
        other_processes=tuple((int(pid), size_bytes(number, unit))
                              for pid, number, unit in _OTHER_PROCESS.findall(full)),
        text=kept)


__all__ = ["parse_oom", "size_bytes"]
