"""Sharded save and load with torch.distributed.checkpoint (DCP): every rank writes and reads only its
own shards, and DCP reshards between layouts (each DTensor knows its place in the whole tensor).

The folder holds ``model`` and ``optimizer_<i>`` (whole-model names, `names.py`), one RNG file per rank,
Lightning's remaining state (loops, schedulers, hyperparameters) in ``meta.pt``, and the manifest.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_nd.checkpoint import files
from lightning_nd.checkpoint.files import CheckpointError
from lightning_nd.checkpoint.names import Names, model_state, optimizer_state, set_model_state, set_optimizer_state

SHOWN = 5


def gather(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def save_sharded(path: Path, state: dict[str, Any], meta: dict[str, Any], rng: dict[str, Any], info: dict[str, Any]) -> None:
    """Every rank: write ``state`` (DCP), its ``rng``; rank 0 also ``meta`` and, once all are done, commits."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    staging = files.staging_path(path)
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that was cut short
        staging.mkdir(parents=True)
    dist.barrier()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(staging, sync_files=True))
    torch.save(rng, staging / files.rng_file(rank))
    if rank == 0:
        torch.save(meta, staging / files.META)
    written = gather(files.own_files(staging, rank))
    if rank == 0:
        files.commit(staging, path, {name: entry for part in written for name, entry in part.items()}, info)
    dist.barrier()


def verify(path: Path) -> dict[str, Any]:
    """Every rank: the manifest, after each rank checked its share of the files (sizes and checksums)."""
    manifest = files.read_manifest(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    share = sorted(manifest["files"])[rank::world]
    found = [problem for part in gather(files.problems(path, manifest, share)) for problem in part]
    files.raise_problems(path, found)
    return manifest


def load_sharded(path: Path, model: nn.Module, optimizers: Sequence[Optimizer], names: Names,
                 strict: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """Load model and optimizers in place; returns Lightning's remaining state, this rank's RNG states
    (None when the world size changed) and the manifest."""
    import torch.distributed.checkpoint as dcp

    manifest = verify(path)
    saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    model_target = model_state(model, names)
    _check_model_keys(path, saved, set(model_target), strict)
    _load(path, {"model": model_target})
    set_model_state(model, names, model_target)
    saved_optimizers = len({key.split(".", 1)[0] for key in saved if key.startswith("optimizer_")})
    if optimizers and saved_optimizers != len(optimizers):
        raise CheckpointError(
            f"Checkpoint `{path}` holds {saved_optimizers} optimizer(s), `configure_optimizers` returned"
            f" {len(optimizers)}. HINT: load the weights only (`LightningModule.load_state_dict`) or build the same optimizers."
        )
    for index, optimizer in enumerate(optimizers):
        target = optimizer_state(model, optimizer, names)
        key = f"optimizer_{index}"
        # Parameters that had not stepped when the checkpoint was saved have no state in it.
        target["state"] = {name: value for name, value in target["state"].items()
                           if all(f"{key}.state.{name}.{field}" in saved for field in value)}
        _load(path, {key: target})
        set_optimizer_state(model, optimizer, names, target)
    meta = torch.load(path / files.META, weights_only=False)
    rank_rng = path / files.rng_file(dist.get_rank())
    same_world = manifest.get("world_size") == dist.get_world_size()
    rng = torch.load(rank_rng, weights_only=False) if same_world and rank_rng.exists() else None
    return meta, rng, manifest


def _load(path: Path, state: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as error:  # DCP wraps every rank's failure; say which checkpoint and what part
        raise CheckpointError(f"Loading `{', '.join(state)}` from `{path}` failed: {error}") from error


def _check_model_keys(path: Path, saved: set[str], wanted: set[str], strict: bool) -> None:
    everywhere = set().union(*gather(wanted))  # under pp each rank holds part: decide on all of it, on every rank
    missing = sorted(name for name in everywhere if f"model.{name}" not in saved)
    unexpected = sorted(key[len("model."):] for key in saved if key.startswith("model.") and key[len("model."):] not in everywhere)
    errors = []
    if missing:
        errors.append(f"{len(missing)} tensor(s) of this model are not in it: {', '.join(missing[:SHOWN])}")
    if unexpected and strict:
        errors.append(f"{len(unexpected)} tensor(s) in it are not in this model: {', '.join(unexpected[:SHOWN])}")
    if errors:
        raise CheckpointError(
            f"Checkpoint `{path}` does not fit the model: {'; '.join(errors)}. HINT: was it saved from another"
            " model or another version of it? Set `strict_loading = False` on the LightningModule to ignore extra tensors."
        )
