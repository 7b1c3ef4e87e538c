"""One file of whole tensors from a sharded checkpoint folder, and that file read back.

Two formats. **safetensors** cannot carry code: the weights under their names, the optimizers' tensors under
``optimizer_states/<i>/<parameter number>/<field>``, and everything else (loops, schedulers, hyper-parameters, the
optimizers' other values) as `json_state` JSON in the file's metadata; `read_export` gives back what ``torch.load``
gives for the other format, and `NDParallel` resumes from it under any layout (`full.load_full`). With ``module`` it
holds one attribute's weights only, without its prefix, for inference and the Hugging Face tools. **torch** is an
ordinary Lightning checkpoint (a pickle, optimizer state by position as `torch.optim` saves it) for a plain
``Trainer`` or ``load_from_checkpoint``; lightning-nd reads it back only through `trusted`'s allow-list.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_nd.checkpoint import files, trusted
from lightning_nd.checkpoint.checked_reader import CheckedReader, read_index
from lightning_nd.checkpoint.files import CheckpointError
from lightning_nd.checkpoint.json_state import decode, encode
from lightning_nd.checkpoint.state_files import read_meta

log = logging.getLogger("lightning_nd")
FORMATS = ("safetensors", "torch")
OPTIMIZER = "optimizer_states/"
STATE = "lightning_nd.state"


def read_sharded(path: Path, progress: Callable[[str], None] = log.info) -> dict[str, Any]:
    """The whole state of a sharded checkpoint in this one process (no process group), checked first."""
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    manifest = files.read_manifest(path)
    progress(f"Checking {len(manifest['files'])} files of `{path}` (sizes and checksums)")
    files.raise_problems(path, files.problems(path, manifest))
    index = read_index(path)
    meta = read_meta(path, manifest)
    progress(f"Reading the shards of {manifest.get('world_size', '?')} ranks (layout {manifest.get('layout')})")
    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=CheckedReader(path, index), planner=trusted.load_planner(path, whole=True),
                         no_dist=True)
    except CheckpointException as error:  # DCP wraps the failure: a value refused is said as it is
        if (refused := trusted.refusal_in(error)) is not None:
            raise refused from None
        raise
    param_names = meta.get("lightning_nd", {}).get("param_names", [])
    optimizers = [positional(state[f"optimizer_{i}"], names) for i, names in enumerate(param_names)
                  if f"optimizer_{i}" in state]  # none in a weights-only checkpoint
    return {**meta, "state_dict": state["model"], "optimizer_states": optimizers}


def positional(state: dict[str, Any], group_names: list[list[str]]) -> dict[str, Any]:
    """Named optimizer state -> `torch.optim` format (parameters numbered across groups in order)."""
    numbered, groups, index = {}, [], 0
    for hyper, names in zip(state["param_groups"], group_names):
        ids = list(range(index, index + len(names)))
        held = state.get("state", {})  # an optimizer with no per-parameter state (plain SGD) saves none
        numbered.update({i: held[name] for i, name in zip(ids, names) if name in held})
        groups.append({**hyper, "params": ids})
        index += len(names)
    return {"state": numbered, "param_groups": groups}


def export(path: Path, out: Path, fmt: str | None = None, module: str | None = None,
           progress: Callable[[str], None] = log.info) -> Path:
    """Write a sharded checkpoint as one file; ``module`` keeps only that attribute's weights, without its prefix.
    ``fmt``: default torch for a ``.ckpt`` or ``.pt`` file (Lightning's), else safetensors."""
    fmt = fmt or ("torch" if out.suffix in (".ckpt", ".pt") else "safetensors")
    if fmt not in FORMATS:
        raise ValueError(f"Unknown export format `{fmt}`. HINT: use one of {', '.join(FORMATS)}.")
    full = read_sharded(path, progress)
    if module is not None:
        prefix = module + "."
        weights = {k[len(prefix):]: v for k, v in full["state_dict"].items() if k.startswith(prefix)}
        if not weights:
            tops = sorted({k.split(".", 1)[0] for k in full["state_dict"]})
            raise ValueError(f"No weights under `{module}` in `{path}`. HINT: choose one of {', '.join(tops)}.")
        full["state_dict"] = weights  # weights only: optimizer state keeps the LightningModule's names
        full.pop("optimizer_states", None)
        full.get("lightning_nd", {}).pop("param_names", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial"
    progress(f"Writing {len(full['state_dict'])} weight tensors to `{out}` ({fmt})")
    if fmt == "torch":
        torch.save(full, partial)
    else:
        _save_safetensors(full, partial, weights_only=module is not None)
    partial.rename(out)
    return out


def _save_safetensors(full: dict[str, Any], out: Path, weights_only: bool) -> None:
    from safetensors.torch import save_file

    tensors = {name: value.contiguous() for name, value in full.pop("state_dict").items()}
    optimizers = full.pop("optimizer_states", [])
    metadata = {"lightning_nd": json.dumps({k: v for k, v in full.get("lightning_nd", {}).items() if k != "param_names"},
                                           default=str)}
    if not weights_only:
        kept = []
        for index, optimizer in enumerate(optimizers):
            values: dict[int, dict[str, Any]] = {}
            for number, fields in optimizer["state"].items():
                for field, value in fields.items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"{OPTIMIZER}{index}/{number}/{field}"] = value.contiguous()
                    else:
                        values.setdefault(number, {})[field] = value
            kept.append({"state": values, "param_groups": optimizer["param_groups"]})
        metadata[STATE] = json.dumps(encode({**full, "optimizer_states": kept}, "the checkpoint's state"))
    save_file(tensors, out, metadata=metadata)


def is_safetensors(path: Path) -> bool:
    """A safetensors file (an 8-byte header length, then the JSON header), whatever its name."""
    with open(path, "rb") as handle:
        start = handle.read(9)
    return len(start) == 9 and start[8:9] == b"{"


def read_export(path: Path) -> dict[str, Any]:
    """A safetensors export as ``torch.load`` gives the torch one (a weights-only one: its weights and layout)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            state = decode(json.loads(metadata[STATE]), "the state") if STATE in metadata else {}
            if not isinstance(state, dict):
                raise ValueError(f"the state is a {type(state).__name__}")  # noqa: TRY004 - caught below, one line
            optimizers = state.get("optimizer_states", [])
            weights = {}
            for key in handle.keys():  # noqa: SIM118 - safe_open is no mapping
                if not key.startswith(OPTIMIZER):
                    weights[key] = handle.get_tensor(key)
                    continue
                index, number, field = key[len(OPTIMIZER):].split("/", 2)
                optimizers[int(index)]["state"].setdefault(int(number), {})[field] = handle.get_tensor(key)
    except (OSError, ValueError, KeyError, IndexError, TypeError, RecursionError, AttributeError,
            SafetensorError) as error:
        raise CheckpointError(f"`{path}` is not a lightning-nd export ({type(error).__name__}: {str(error)[:200]})."
                              " HINT: export the checkpoint again.") from None
    if STATE not in metadata:  # weights only
        state = {"lightning_nd": json.loads(metadata.get("lightning_nd", "{}"))}
    return {**state, "state_dict": weights, "optimizer_states": optimizers}
