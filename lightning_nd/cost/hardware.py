"""What the cost model assumes of one accelerator and its links: `Hardware`, the `PRESETS`, and the parsers of
``--hardware h100,peak_flops=7e14`` and ``--gpu-memory 80GB``.

Figures are the vendors' datasheet peaks, per GPU, one direction; nothing here measures anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Any

from lightning_nd.mesh.dims import closest_name


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links, as datasheet peaks."""

    name: str
    peak_flops: float
    """Dense (no sparsity) bf16 tensor FLOP/s; the cost model runs every step at this rate."""
    memory_bytes: int
    """Memory of one accelerator."""
    intra_node_bytes_per_s: float
    """NVLink (or the node's own fabric) per GPU, one direction: half the "total bandwidth" datasheets quote."""
    inter_node_bytes_per_s: float
    """Network per GPU, one direction (one NIC per GPU: 400 Gb/s = 50e9 bytes/s)."""


PRESETS = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 80GB: BF16 1,979 TFLOPS with sparsity (989 dense), 80 GB HBM3,
    # NVLink 900 GB/s (both directions); DGX H100: one 400 Gb/s ConnectX-7 per GPU.
    "h100": Hardware("h100", 989e12, 80 * 10**9, 450e9, 50e9),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM: the H100's compute and NVLink, 141 GB HBM3e; DGX H200: 400 Gb/s
    # per GPU.
    "h200": Hardware("h200", 989e12, 141 * 10**9, 450e9, 50e9),
    # NVIDIA A100 Tensor Core GPU datasheet, SXM 80GB: BF16 312 TFLOPS dense, NVLink 600 GB/s (both directions);
    # DGX A100: one 200 Gb/s HDR InfiniBand port per GPU.
    "a100": Hardware("a100", 312e12, 80 * 10**9, 300e9, 25e9),
    # NVIDIA HGX B200 datasheet (8 GPUs): FP16/BF16 36 PFLOPS with sparsity (2.25 PFLOPS dense per GPU), 1,440 GB
    # HBM3e (180 GB per GPU), NVLink 5 1.8 TB/s per GPU (both directions); DGX B200: 400 Gb/s ConnectX-7 per GPU.
    "b200": Hardware("b200", 2.25e15, 180 * 10**9, 900e9, 50e9),
    # ROUGH, no datasheet: a 2-core x86 machine like the one this project is tested on (2 cores x ~2.4 GHz x 32 fp32
    # FLOP/cycle with AVX2 FMA, 24 GB of RAM), gloo over shared memory within it, 10 GbE between machines.
    "cpu": Hardware("cpu", 1.5e11, 24 * 10**9, 5e9, 1.25e9),
}
OVERRIDABLE = tuple(f.name for f in fields(Hardware) if f.name != "name")
BYTE_UNITS = {"": 10**9, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
"""A bare number is GB."""
SIZE = re.compile(r"\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_hardware(text: str) -> Hardware:
    """``h100`` or ``h100,peak_flops=7e14,inter_node_bytes_per_s=25e9``: a preset, with fields overridden
    (``memory_bytes`` also takes a size such as ``96GB``)."""
    name, *overrides = (part.strip() for part in text.split(","))
    if name.lower() not in PRESETS:
        raise ValueError(f"Unknown hardware `{name}` in `{text}`. HINT: did you mean"
                         f" `{closest_name(name, list(PRESETS))}`? Presets: {', '.join(PRESETS)}; override a field"
                         " with e.g. `h100,peak_flops=7e14`.")
    changes: dict[str, Any] = {}
    for part in filter(None, overrides):
        field, _, value = (piece.strip() for piece in part.partition("="))
        if field not in OVERRIDABLE:
            raise ValueError(f"`{part}` in `{text}` names no field of `Hardware`. HINT: did you mean"
                             f" `{closest_name(field, OVERRIDABLE)}`? Fields: {', '.join(OVERRIDABLE)}.")
        changes[field] = _field_value(field, value, text)
    return replace(PRESETS[name.lower()], **changes)


def _field_value(field: str, value: str, text: str) -> float | int:
    try:
        number = float(value)
    except ValueError:
        if field == "memory_bytes":
            return parse_bytes(value)
        raise ValueError(f"`{field}={value}` in `{text}` is not a number. HINT: e.g. `{field}=5e10`.") from None
    if number <= 0:
        raise ValueError(f"`{field}={value}` in `{text}` must be positive. HINT: e.g. `{field}=5e10`.")
    return int(number) if field == "memory_bytes" else number


def parse_bytes(text: str) -> int:
    """``80GB`` (10**9 units), ``80GiB`` (2**30), ``512MB``, ``512MiB``; a bare number is GB."""
    match = SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in BYTE_UNITS or float(match.group(1)) <= 0:
        units = ", ".join(known.upper().replace("I", "i") for known in BYTE_UNITS if known)
        raise ValueError(f"`{text}` is not a memory size. HINT: write e.g. `80GB` (10**9 bytes) or `80GiB` (2**30);"
                         f" units: {units}; a bare number is GB.")
    return round(float(match.group(1)) * BYTE_UNITS[unit])
