"""A one-file checkpoint loaded into any layout: an export (`export.py`: safetensors, read as data; or torch) or any
Lightning checkpoint. Optimizer state comes by position, as `torch.optim` saves it; ``lightning_nd.param_names``
records which parameter each position is, so it goes back under any layout.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_nd.checkpoint import trusted
from lightning_nd.checkpoint.export import is_safetensors, read_export
from lightning_nd.checkpoint.files import CheckpointError, CheckpointMismatch
from lightning_nd.checkpoint.names import Names, get_local_names, group_names, set_optimizer_state
from lightning_nd.checkpoint.sharded import check_shapes, gather

log = logging.getLogger("lightning_nd")


def named(state: dict[str, Any], group_names: list[list[str]]) -> dict[str, Any]:
    """`torch.optim` format -> named optimizer state (`names.optimizer_state`'s)."""
    flat = [name for names in group_names for name in names]
    return {"state": {flat[i]: value for i, value in state["state"].items()},
            "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]}


def load_full(path: Path, model: nn.Module, optimizers: Sequence[Optimizer], names: Names,
              strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
    """Load a one-file checkpoint (an export, or any Lightning checkpoint) into this rank's shards; returns
    the rest of it (loops, schedulers) for Lightning."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    if is_safetensors(path):  # an export that cannot carry code
        checkpoint = read_export(path)
    elif weights_only is None:  # nobody asked: read as data through the allow-list (`trusted.py`), no code runs
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
