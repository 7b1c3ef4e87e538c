"""One-file checkpoints: export a sharded checkpoint to whole tensors, and load a whole-tensor file into
any layout.

The torch file is an ordinary Lightning checkpoint (``state_dict``, ``optimizer_states`` keyed by
position as `torch.optim` saves them, loops, schedulers, hyperparameters): a plain ``Trainer`` resumes
from it and ``LightningModule.load_from_checkpoint`` reads it. ``lightning_nd.param_names`` records
which parameter each position is, so `load_full` puts optimizer state back under any layout. The
safetensors file holds the model's weights (and the layout as metadata), for inference and the
Hugging Face tools.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_nd.checkpoint import files, trusted
from lightning_nd.checkpoint.checked_reader import CheckedReader, read_index
from lightning_nd.checkpoint.files import CheckpointError, CheckpointMismatch
from lightning_nd.checkpoint.names import Names, get_local_names, group_names, set_optimizer_state
from lightning_nd.checkpoint.sharded import check_shapes, gather
from lightning_nd.checkpoint.state_files import read_meta

log = logging.getLogger("lightning_nd")


def read_sharded(path: Path, progress: Callable[[str], None] = log.info) -> dict[str, Any]:
    """The whole state of a sharded checkpoint in this one process (no process group), checked first."""
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    manifest = files.read_manifest(path)
    progress(f"Checking {len(manifest['files'])} files of `{path}` (sizes and checksums)")
    files.raise_problems(path, files.problems(path, manifest))
    read_index(path)
    meta = read_meta(path, manifest)
    progress(f"Reading the shards of {manifest.get('world_size', '?')} ranks (layout {manifest.get('layout')})")
    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=CheckedReader(path), planner=trusted.load_planner(path, whole=True),
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


def named(state: dict[str, Any], group_names: list[list[str]]) -> dict[str, Any]:
    """`torch.optim` format -> named optimizer state (`names.optimizer_state`'s)."""
    flat = [name for names in group_names for name in names]
    return {"state": {flat[i]: value for i, value in state["state"].items()},
            "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]}


def export(path: Path, out: Path, fmt: str = "torch", module: str | None = None,
           progress: Callable[[str], None] = log.info) -> Path:
    """Write a sharded checkpoint as one file; ``module`` keeps only that attribute's weights, without its prefix."""
    if fmt not in ("torch", "safetensors"):
        raise ValueError(f"Unknown export format `{fmt}`. HINT: use `torch` or `safetensors`.")
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
        from safetensors.torch import save_file

        info = {k: v for k, v in full.get("lightning_nd", {}).items() if k != "param_names"}
        tensors = {k: v.contiguous() for k, v in full["state_dict"].items()}
        save_file(tensors, partial, metadata={"lightning_nd": json.dumps(info, default=str)})
    partial.rename(out)
    return out


def load_full(path: Path, model: nn.Module, optimizers: Sequence[Optimizer], names: Names,
              strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
    """Load a one-file checkpoint (an export, or any Lightning checkpoint) into this rank's shards; returns
    the rest of it (loops, schedulers) for Lightning."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    if weights_only is None:  # nobody asked: read as data through the allow-list (`trusted.py`), no code runs
        checkpoint = trusted.load_whole(path)
    else:  # as asked: torch's own weights-only unpickler, or a file the caller trusts
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    if "state_dict" not in checkpoint:
        raise CheckpointError(f"`{path}` has no `state_dict`: it is not a Lightning checkpoint or an export of one.")
    weights = checkpoint.pop("state_dict")
    local = get_local_names(model)
    wanted = set().union(*gather({names.original(name) for name in local}))
    missing, unexpected = sorted(wanted - weights.keys()), sorted(weights.keys() - wanted)
    if (missing or unexpected) and strict:
        raise CheckpointMismatch(
            f"`{path}` does not fit the model: missing {missing[:5]} ({len(missing)} in all), unexpected"
            f" {unexpected[:5]} ({len(unexpected)} in all). HINT: was it saved from another model? Set"
            " `strict_loading = False` on the LightningModule to load what matches."
        )
    own = get_model_state_dict(model)  # whole shapes (a DTensor's shape is the whole tensor's)
    check_shapes(path, {name: weights[names.original(name)].shape for name in local if names.original(name) in weights},
                 dict(own))
    set_model_state_dict(model, {name: weights[names.original(name)] for name in local if names.original(name) in weights},
                         options=StateDictOptions(full_state_dict=True, strict=strict))
    saved = checkpoint.pop("optimizer_states", [])
    param_names = checkpoint.get("lightning_nd", {}).get("param_names")
    if optimizers and len(saved) == len(optimizers):
        if param_names is None:
            param_names = _names_by_position(model, optimizers, names, saved, path)
        for optimizer, state, saved_names in zip(optimizers, saved, param_names):
            set_optimizer_state(model, optimizer, names, named(state, saved_names), full=True)
    elif optimizers:
        log.warning(f"`{path}` holds {len(saved)} optimizer state(s) for {len(optimizers)} optimizer(s):"
                    " the optimizers start fresh.")
    dist.barrier()
    return checkpoint


def _names_by_position(model: nn.Module, optimizers: Sequence[Optimizer], names: Names, saved: list[dict[str, Any]],
                       path: Path) -> list[list[list[str]]]:
    """A plain Lightning checkpoint numbers parameters across its optimizer's groups, in order: this run's
    optimizers (the same `configure_optimizers`) say which parameter each number is."""
    if any(names.original(name) != name for name, _ in model.named_parameters()):
        raise CheckpointError(
            f"`{path}` numbers optimizer state by position, which a pipeline stage cannot map to parameters."
            " HINT: load it once without pipeline parallelism and save again, or load the weights only."
        )
    result = []
    for optimizer, state in zip(optimizers, saved):
        live = group_names(model, optimizer, names)
        if [len(group) for group in live] != [len(group["params"]) for group in state["param_groups"]]:
            raise CheckpointError(f"`{path}`: the optimizer's parameter groups differ from this run's. HINT: build the"
                                  " same groups in `configure_optimizers`, or load the weights only.")
        flat = [name for group in live for name in group]
        result.append([[flat[i] for i in group["params"]] for group in state["param_groups"]])
    return result
