"""Which complete checkpoints a set of folders holds, and which one a run resumes from.

A candidate is a folder with a manifest of the right shape whose every file is present at its size (`files.py`). A
malformed or implausible manifest (not JSON, a missing field, a ``saved_at`` that is not a time or lies in the future)
is skipped with one warning naming it, never an exception that stops the listing. Candidates are ordered newest saved
first, those this run wrote before all others (a restarted or requeued generation resumes its own newest even when
another job saves into the same folder); a run with none of its own takes the newest complete one and says whose.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from lightning_nd.checkpoint.files import MANIFEST, CheckpointError, problems, read_manifest
from lightning_nd.runtime.job import run_key

log = logging.getLogger("lightning_nd")
FUTURE_S = 24 * 3600.0
"""A manifest saved more than this far in the future of this host's clock is implausible (clocks of hosts differ by
seconds, not days): it would win every resume."""
REPLACED = ".replaced"
"""A checkpoint being replaced where the file system cannot swap two folders at once (`commit.py`): if the new one is
not in place yet, this hidden copy is the checkpoint of that name."""


def complete_manifests(*folders: str | os.PathLike, run: str | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """The complete lightning-nd checkpoints in ``folders`` with their manifests: ``run``'s own first (default: this
    process's run), newest saved first within each. Links (``last.ckpt``) are skipped: what they name is found anyway. A
    folder that does not exist holds none."""
    found: dict[Path, tuple[Path, dict[str, Any]]] = {}  # by real path: two folders given may be one
    now = time.time()
    for folder in map(Path, folders):
        if not folder.is_dir():
            continue
        for path in _entries(folder):
            if path.is_symlink() or not path.is_dir() or not _candidate(path):
                continue
            try:
                manifest = read_manifest(path)
            except CheckpointError as error:
                if (path / MANIFEST).exists():  # a checkpoint cut short has none: no news
                    log.warning(f"lightning-nd: skipped `{path}`: {error}")
                continue
            if manifest["saved_at"] > now + FUTURE_S:
                log.warning(f"lightning-nd: skipped `{path}`: its manifest says it was saved at {manifest['saved_at']},"
                            f" {manifest['saved_at'] - now:.0f} s from now. HINT: check the clocks, or resume from it by"
                            " its path.")
                continue
            if not problems(path, manifest, checksum=False):
                found[path.resolve()] = (path, manifest)
    mine = run if run is not None else run_key()
    return sorted(found.values(), key=lambda item: (item[1].get("run") == mine, item[1]["saved_at"], str(item[0])),
                  reverse=True)


def _candidate(path: Path) -> bool:
    """A checkpoint's folder: a visible one, or a replaced one whose new copy never took its place."""
    if not path.name.startswith("."):
        return True
    return path.name.endswith(REPLACED) and not (path.parent / path.name[1:-len(REPLACED)]).exists()


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError as error:
        raise CheckpointError(f"`{folder}` cannot be read ({error.strerror or error}). HINT: give this user read access"
                              " to it (permissions, a mounted file system), or point at another folder.") from None


def whose(manifest: dict[str, Any], run: str | None = None) -> str:
    """``""`` for a checkpoint of this run, else who wrote it (said when a run resumes from another's)."""
    writer = manifest.get("run")
    if writer == (run if run is not None else run_key()):
        return ""
    return f"written by run `{writer}`" if writer else "written by a run that recorded no name"


def complete_checkpoints(*folders: str | os.PathLike) -> list[Path]:
    """The complete lightning-nd checkpoints in ``folders``, in the order a resume tries them (`complete_manifests`)."""
    return [path for path, _ in complete_manifests(*folders)]


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The checkpoint in ``folder`` a resume takes first (`complete_manifests`), or None."""
    if not Path(folder).is_dir():
        raise CheckpointError(f"`{folder}` is not a folder.")
    found = complete_checkpoints(folder)
    return found[0] if found else None


def resume_path(*folders: str | os.PathLike) -> str | None:
    """The checkpoint in ``folders`` to resume from, for a script's own ``Trainer.fit(ckpt_path=...)`` (None: start
    fresh). Under `NDParallel`, ``ckpt_path="auto"`` chooses the same on rank 0 for every rank, and falls back to an
    older checkpoint when the newest fails to load."""
    found = complete_checkpoints(*folders)
    return str(found[0]) if found else None
