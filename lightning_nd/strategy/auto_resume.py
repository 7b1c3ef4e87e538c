"""``Trainer.fit(..., ckpt_path="auto")``: resume from the newest complete checkpoint of this run, or start fresh.

Lightning passes a ``ckpt_path`` it does not know through to its checkpoint connector's ``resume_start``, which asks the
strategy to load it. That is the first point where the processes exist, so `NDParallel` translates ``"auto"`` there:
rank 0 lists the complete checkpoints (`checkpoint.listing.complete_manifests`: a manifest, every file at its size) in
every `ModelCheckpoint`'s folder and in ``default_root_dir`` (where Lightning's SLURM requeue writes ``hpc_ckpt_<N>``),
this run's own first, newest saved first, and every rank gets that list (one written by another run says whose). The
newest that loads wins, whichever callback wrote it (an ``hpc_ckpt`` written at a requeue is newer than the periodic
save before it); one that fails to load (truncated, corrupt, unreadable) is skipped with a warning and the one before it
tried. A checkpoint of another model is refused
(an older one would not fit either). None: a fresh start, said once.

For a script that decides the path itself, `lightning_nd.checkpoint.resume_path(*folders)` gives the same choice in
one process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from lightning_nd.checkpoint.files import CheckpointError, CheckpointMismatch, said
from lightning_nd.checkpoint.listing import complete_manifests, whose

AUTO = "auto"
log = logging.getLogger("lightning_nd")


def search_folders(trainer: Trainer) -> list[str]:
    """Where a run's checkpoints are: every checkpoint callback's folder, and the root folder (``hpc_ckpt_<N>``)."""
    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, undeclared
    folders = [callback.dirpath for callback in callbacks
               if isinstance(callback, (ModelCheckpoint, OnExceptionCheckpoint)) and callback.dirpath]
    return list(dict.fromkeys([*map(str, folders), str(trainer.default_root_dir)]))


class AutoResume:
    """Installs the ``"auto"`` translation on a Trainer's checkpoint connector (once per fit, after the processes
    start); ``broadcast`` gives rank 0's value to every rank."""

    def __init__(self, broadcast: Callable[[Any], Any], is_global_zero: Callable[[], bool]) -> None:
        self._broadcast, self._is_global_zero = broadcast, is_global_zero

    def install(self, trainer: Trainer) -> None:
        connector = trainer._checkpoint_connector
        resume_start = _CheckpointConnector.resume_start  # the class's: installing twice wraps it once

        def resume(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
            if checkpoint_path != AUTO:
                return resume_start(connector, checkpoint_path, weights_only)
            folders = search_folders(trainer)
            # Rank 0 reads the manifests, once each; every rank gets the paths, their steps and who wrote them.
            found = self._broadcast(_listed(folders) if self._is_global_zero() else None)
            if isinstance(found, str):
                raise CheckpointError(found)
            for index, (path, step, writer) in enumerate(found):
                try:
                    self._say(_resuming(path, step, folders, skipped=index, writer=writer))
                    return resume_start(connector, path, weights_only)
                except CheckpointMismatch:
                    raise
                except CheckpointError as error:
                    older = f"; trying `{found[index + 1][0]}`" if index + 1 < len(found) else ""
                    self._say(f"lightning-nd: `ckpt_path='auto'` could not load `{path}` ({error}){older}.", warn=True)
            self._say(f"lightning-nd: `ckpt_path='auto'` found no complete checkpoint in {', '.join(folders)}"
                      + (" that loads" if found else "") + ": starting from the first step.", warn=bool(found))
            return resume_start(connector, None, weights_only)

        connector.resume_start = resume  # type: ignore[method-assign]

    def _say(self, message: str, warn: bool = False) -> None:
        if self._is_global_zero():
            (log.warning if warn else log.info)(message)


def _listed(folders: list[str]) -> list[tuple[str, int | None, str]] | str:
    """The candidates (`complete_manifests`), or why they cannot be listed (said on every rank, none left waiting)."""
    try:
        return [(str(path), manifest.get("global_step"), whose(manifest)) for path, manifest in complete_manifests(*folders)]
    except Exception as error:  # noqa: BLE001 - raised on every rank by the caller
        return said(error)


def _resuming(path: str, step: int | None, folders: list[str], skipped: int, writer: str) -> str:
    older = f" ({skipped} newer could not be loaded)" if skipped else ""
    theirs = f", {writer}: this run has none of its own" if writer else ""
    return (f"lightning-nd: `ckpt_path='auto'` resumes from `{path}` (step {step}{theirs}), the newest"
            f" complete checkpoint{older} in {', '.join(folders)}.")
