"""Sharded save and load with torch.distributed.checkpoint (DCP): every rank writes and reads only its
own shards, and DCP reshards between layouts (each DTensor knows its place in the whole tensor).

The folder holds ``model`` and ``optimizer_<i>`` (whole-model names, `names.py`), one RNG file per rank,
Lightning's remaining state (loops, schedulers, hyperparameters) in ``meta.json`` (`state_files.py`), and the manifest.
Every DCP read goes through `CheckedReader`; a checkpoint refused on one rank, for whatever reason, is refused on all.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.optim import Optimizer

from lightning_nd.checkpoint import files, trusted
from lightning_nd.checkpoint.checked_reader import CheckedReader, read_index
from lightning_nd.checkpoint.commit import commit
from lightning_nd.checkpoint.files import CheckpointError, CheckpointMismatch
from lightning_nd.checkpoint.names import Names, model_state, optimizer_state, set_model_state, set_optimizer_state
from lightning_nd.checkpoint.state_files import read_meta, read_rng, write_meta, write_rng
from lightning_nd.checkpoint.strided import contiguous, restore
from lightning_nd.runtime.job import run_key

SHOWN = 5
STALE_STAGING_S = 3600.0
"""Another run's staging folder of a name, untouched this long, is a save that died: the next save of that name removes
it. Younger, it may be a save in progress of a job sharing the folder, and stays."""
log = logging.getLogger("lightning_nd")


def gather(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def on_rank0(action: Callable[[], Any], group: dist.ProcessGroup | None = None) -> Any:
    """Run ``action`` on rank 0 only and return its result on every rank; if it fails, every rank raises its error
    (none is left waiting). ``group``: one over every rank (rank 0 in it is global rank 0)."""
    outcome: list[Any] = [None, None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = action()
        except Exception as failure:  # noqa: BLE001 - raised on every rank below
            outcome[1] = files.said(failure)
    dist.broadcast_object_list(outcome, src=0, group=group)
    if outcome[1] is not None:
        raise CheckpointError(f"Saving the checkpoint failed on rank 0: {outcome[1]}")
    return outcome[0]


def save_sharded(path: Path, state: dict[str, Any], meta: dict[str, Any], rng: dict[str, Any], info: dict[str, Any]) -> None:
    """Every rank: write ``state`` (DCP), its ``rng``; rank 0 also ``meta`` and, once all are done, commits."""
    import torch.distributed.checkpoint as dcp

    staging = begin_save(path, meta)
    swaps = contiguous(state)
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(staging, sync_files=True))
    finally:
        restore(swaps, loaded=False)
    write_rng(staging, dist.get_rank(), rng)
    finish_save(path, staging, info)


def begin_save(path: Path, meta: dict[str, Any]) -> Path:
    """Every rank: this run's hidden staging folder of ``path`` (rank 0's choice), made empty by rank 0 with Lightning's
    ``meta`` in it."""

    def prepare() -> Path:
        files.check_target(path)
        staging = files.staging_path(path, run_key())
        for cut_short in [staging, *files.stale_stagings(path, STALE_STAGING_S)]:  # another run's only when idle
            shutil.rmtree(cut_short, ignore_errors=True)
        staging.mkdir(parents=True)
        write_meta(staging, meta)
        return staging

    return Path(on_rank0(prepare))


def finish_save(path: Path, staging: Path, info: dict[str, Any], group: dist.ProcessGroup | None = None) -> None:
    """Every rank, once its files are written: what each rank wrote is gathered and rank 0 commits (`commit.py`).
    ``group``: where these collectives run (the checkpoint's own group when a background thread calls this)."""
    written = gather(files.own_files(staging, dist.get_rank()), group)
    on_rank0(lambda: commit(staging, path, {name: entry for part in written for name, entry in part.items()}, info),
             group)


def verify(path: Path) -> dict[str, Any]:
    """Every rank: each rank checks its share of the files the manifest lists (sizes and checksums); all raise, the
    same error (a manifest one rank cannot read included). Returns the manifest."""
    manifest: dict[str, Any] = {}
    found: list[str] = []
    try:
        manifest = files.read_manifest(path)
        rank, world = dist.get_rank(), dist.get_world_size()
        found = files.problems(path, manifest, sorted(manifest["files"])[rank::world])
    except Exception as error:  # noqa: BLE001 - said on every rank below
        found = [files.said(error)]
    everywhere = [problem for part in gather(found) for problem in part]
    if everywhere and not manifest:
        raise CheckpointError(everywhere[0])
    files.raise_problems(path, everywhere)
    return manifest


def load_sharded(path: Path, model: nn.Module, optimizers: Sequence[Optimizer], names: Names,
                 strict: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Load model and optimizers in place; returns Lightning's remaining state and this rank's RNG states
    (None when the checkpoint has none for this rank)."""

    meta, rng, stored = _read_states(path, verify(path))
    metadata = stored.state_dict_metadata
    saved = set(metadata)
    model_target = model_state(model, names)
    missing = _check_model_keys(path, saved, set(model_target), strict)
    check_shapes(path, {name: getattr(metadata[f"model.{name}"], "size", None) for name in model_target
                        if f"model.{name}" in metadata}, model_target)
    _load(path, stored, {"model": {k: v for k, v in model_target.items() if k not in missing}})
    set_model_state(model, names, model_target, strict=strict)
    _check_optimizers(path, saved, optimizers)
    for index, optimizer in enumerate(optimizers):
        target = optimizer_state(model, optimizer, names, create=True)
        key = f"optimizer_{index}"
        # Parameters that had not stepped when the checkpoint was saved have no state in it.
        target["state"] = {name: value for name, value in target["state"].items()
                           if all(f"{key}.state.{name}.{field}" in saved for field in value)}
        _load(path, stored, {key: target})
        if not target["state"]:
            optimizer.state.clear()  # saved before its first step: drop what creating the load target made
        set_optimizer_state(model, optimizer, names, target)
    return meta, rng


def _read_states(path: Path, manifest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None, Metadata]:
    """Every rank, before any weights: DCP's index (`checked_reader`), Lightning's state and this rank's random states
    (`state_files`); whatever fails on one rank (a refused file, a malformed one, one asking for too much memory) is
    raised on all, so none is left waiting in DCP's collectives."""
    meta: dict[str, Any] = {}
    rng, index, error = None, None, None
    try:
        index = read_index(path)
        meta = read_meta(path, manifest)
        rng = read_rng(path, manifest, dist.get_rank())
    except Exception as failure:  # noqa: BLE001 - said on every rank below
        error = files.said(failure, path)
    if errors := [message for message in gather(error) if message is not None]:
        raise CheckpointError(errors[0])
    return meta, rng, cast("Metadata", index)  # read, or raised above


def _check_optimizers(path: Path, saved: set[str], optimizers: Sequence[Optimizer]) -> None:
    groups: dict[str, set[str]] = {}
    for key in saved:
        if key.startswith("optimizer_"):
            name, _, rest = key.partition(".")
            groups.setdefault(name, set()).update([rest.split(".")[1]] if rest.startswith("param_groups.") else [])
    if optimizers and not groups:
        raise CheckpointMismatch(
            f"Checkpoint `{path}` holds no optimizer state (saved with `save_weights_only=True`?), so training cannot"
            " resume from it. HINT: load the weights (`LightningModule.load_state_dict`, or an export) and start the"
            " optimizer fresh, or resume from a full checkpoint."
        )
    found = [len(groups.get(f"optimizer_{i}", ())) for i in range(len(optimizers))]
    wanted = [len(optimizer.param_groups) for optimizer in optimizers]
    if optimizers and (len(groups) != len(optimizers) or found != wanted):
        raise CheckpointMismatch(
            f"Checkpoint `{path}` holds {len(groups)} optimizer(s) with {found} parameter groups; `configure_optimizers`"
            f" built {len(optimizers)} with {wanted}. HINT: build the same optimizers and groups as the run that saved it."
        )


def _load(path: Path, stored: Metadata, state: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    swaps = contiguous(state)
    try:
        dcp.load(state, storage_reader=CheckedReader(path, stored), planner=trusted.load_planner(path))
    except (Exception, dcp.CheckpointException) as error:  # DCP's wrapper of every rank's failure is no `Exception`
        restore(swaps, loaded=False)
        failed = CheckpointError(f"Loading `{', '.join(state)}` from `{path}` failed: {error}")
        raise trusted.refusal_in(error) or failed from error  # a refused value is said as it is
    restore(swaps, loaded=True)


def _check_model_keys(path: Path, saved: set[str], wanted: set[str], strict: bool) -> set[str]:
    """This model's tensors the checkpoint lacks (allowed, and returned, only when not ``strict``)."""
    everywhere = set().union(*gather(wanted))  # under pp each rank holds part: decide on all of it, on every rank
    missing = sorted(name for name in everywhere if f"model.{name}" not in saved)
    unexpected = sorted(key[len("model."):] for key in saved if key.startswith("model.") and key[len("model."):] not in everywhere)
    errors = []
    if missing:
        errors.append(f"{len(missing)} tensor(s) of this model are not in it: {', '.join(missing[:SHOWN])}")
    if unexpected:
        errors.append(f"{len(unexpected)} tensor(s) in it are not in this model: {', '.join(unexpected[:SHOWN])}")
    if errors and strict:
        raise CheckpointMismatch(
            f"Checkpoint `{path}` does not fit the model: {'; '.join(errors)}. HINT: was it saved from another"
            " model or another version of it? Set `strict_loading = False` on the LightningModule to load what matches."
        )
    if errors:
        log.warning(f"lightning-nd: `{path}` partly fits the model (strict_loading=False): {'; '.join(errors)}")
    return set(missing) & wanted


def check_shapes(path: Path, saved: dict[str, Any], model_state: dict[str, Any]) -> None:
    """Every rank: refuse (on all of them) a checkpoint whose tensors have other shapes than this model's (another
    vocabulary, another width), naming both shapes; ``saved``: name -> its whole shape in the checkpoint."""
    wrong = [(name, list(saved[name]), list(value.shape)) for name, value in model_state.items()
             if saved.get(name) is not None and hasattr(value, "shape") and tuple(saved[name]) != tuple(value.shape)]
    everywhere = sorted({(name, tuple(old), tuple(new)) for part in gather(wrong) for name, old, new in part})
    if everywhere:
        shown = "; ".join(f"`{name}` is {list(old)} in it, {list(new)} in this model" for name, old, new in everywhere[:SHOWN])
        raise CheckpointMismatch(
            f"Checkpoint `{path}` does not fit the model: {len(everywhere)} tensor(s) have other shapes ({shown}). HINT:"
            " it was saved from a model of another size (vocabulary, width, layers): build the model it was saved"
            " from, or start from a checkpoint of this one."
        )
