"""A checkpoint on disk: a folder that appears whole or not at all, and says what it must contain.

Every rank writes into ``.<name>.partial`` next to the final path. Once all have written, rank 0
writes the manifest (each file, who wrote it, its size and CRC32) and renames the folder into place.
A save cut short leaves only the hidden ``.partial`` folder, which no search for checkpoints matches,
and a folder without a manifest, or whose files disagree with it, is refused with the missing piece named.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

MANIFEST = "lightning_nd.json"
META = "meta.pt"
DCP_METADATA = ".metadata"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: incomplete, truncated, corrupt, or from another model."""


class CheckpointMismatch(CheckpointError):
    """A readable checkpoint of another model (other tensors, other shapes, other optimizers): an older checkpoint of
    the same run would not fit either, so resuming never falls back past it."""


def staging_path(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def rng_file(rank: int) -> str:
    return f"rng-{rank}.pt"


def crc32(path: Path, chunk: int = 1 << 22) -> int:
    value = 0
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            value = zlib.crc32(block, value)
    return value


def own_files(folder: Path, rank: int) -> dict[str, dict[str, int]]:
    """The files ``rank`` wrote into ``folder`` (its DCP shards, its RNG states; rank 0 also the metadata)."""
    names = [p.name for p in folder.iterdir() if p.name.startswith(f"__{rank}_")] + [rng_file(rank)]
    if rank == 0:
        names += [DCP_METADATA, META]
    return {name: {"rank": rank, "bytes": (folder / name).stat().st_size, "crc32": crc32(folder / name)}
            for name in sorted(names)}


def check_target(path: Path) -> None:
    """Saving replaces an earlier checkpoint of that name, never a folder of something else."""
    if path.is_dir() and not path.is_symlink() and not (path / MANIFEST).exists() and any(path.iterdir()):
        raise CheckpointError(
            f"`{path}` is a folder that is not a lightning-nd checkpoint; saving there would replace it."
            " HINT: save to a new path, e.g. inside that folder."
        )


def commit(staging: Path, path: Path, files: dict[str, dict[str, int]], info: dict[str, Any]) -> None:
    """Rank 0, once every rank has written: the manifest last, then the folder into place."""
    manifest = {"format": FORMAT_VERSION, "saved_at": time.time(), "files": files, **info}
    with open(staging / MANIFEST, "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():  # saving over a checkpoint (``last.ckpt``): the old one leaves only once the new one is whole
        old = path.parent / f".{path.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        staging.rename(path)
        shutil.rmtree(old)
        return
    staging.rename(path)


def read_manifest(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise CheckpointError(f"There is no checkpoint at `{path}`.")
    if not path.is_dir():
        raise CheckpointError(f"`{path}` is a file, not a sharded lightning-nd checkpoint folder.")
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(
            f"`{path}` has no `{MANIFEST}`: its save never finished (a rank died or the job was stopped while"
            " writing), or it was not written by lightning-nd. HINT: resume from an older checkpoint."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except OSError as error:
        raise CheckpointError(f"`{manifest_path}` cannot be read ({error.strerror or error}). HINT: give this user read"
                              " access to the checkpoint (permissions, a mounted file system), or resume from another"
                              " checkpoint.") from None
    except ValueError as error:
        raise CheckpointError(f"`{manifest_path}` is corrupt ({error}). HINT: resume from an older checkpoint.") from None
    if manifest.get("format", 0) > FORMAT_VERSION:
        raise CheckpointError(f"`{path}` was written by a newer lightning-nd (format {manifest['format']}, this one reads"
                              f" {FORMAT_VERSION}). HINT: upgrade lightning-nd.")
    return manifest


def problems(path: Path, manifest: dict[str, Any], names: list[str] | None = None, checksum: bool = True) -> list[str]:
    """What is wrong with the files (``names``, default all) the manifest lists: missing, truncated, corrupt."""
    found = []
    for name in names if names is not None else sorted(manifest["files"]):
        entry, file = manifest["files"][name], path / name
        writer = f"written by rank {entry['rank']}"
        if not file.exists():
            found.append(f"`{name}` ({writer}) is missing")
        elif (size := file.stat().st_size) != entry["bytes"]:
            found.append(f"`{name}` ({writer}) has {size} bytes, {entry['bytes']} were written (truncated)")
        elif checksum and crc32(file) != entry["crc32"]:
            found.append(f"`{name}` ({writer}) does not match its checksum (corrupt)")
    return found


def raise_problems(path: Path, found: list[str]) -> None:
    if found:
        raise CheckpointError(f"Checkpoint `{path}` cannot be loaded: " + "; ".join(found)
                              + ". HINT: resume from an older checkpoint.")


def is_complete(path: Path) -> bool:
    """Whole as far as a quick look tells: a manifest, and every file it lists present at its size."""
    return _complete_manifest(path) is not None


def _complete_manifest(path: Path) -> dict[str, Any] | None:
    """``path``'s manifest where it is complete (`is_complete`), read once; else None."""
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        return None
    return None if problems(path, manifest, checksum=False) else manifest


def complete_manifests(*folders: str | os.PathLike) -> list[tuple[Path, dict[str, Any]]]:
    """The complete lightning-nd checkpoints in ``folders`` with their manifests, newest (by save time) first. Links
    (``last.ckpt``) are skipped: what they name is found anyway. A folder that does not exist holds none."""
    found: dict[Path, tuple[Path, dict[str, Any]]] = {}  # by real path: two folders given may be one
    for folder in map(Path, folders):
        if not folder.is_dir():
            continue
        for path in _entries(folder):
            if not path.name.startswith(".") and not path.is_symlink() and path.is_dir():
                manifest = _complete_manifest(path)
                if manifest is not None:
                    found[path.resolve()] = (path, manifest)
    return sorted(found.values(), key=lambda item: (item[1]["saved_at"], str(item[0])), reverse=True)


def complete_checkpoints(*folders: str | os.PathLike) -> list[Path]:
    """The complete lightning-nd checkpoints in ``folders``, newest (by save time) first (`complete_manifests`)."""
    return [path for path, _ in complete_manifests(*folders)]


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError as error:
        raise CheckpointError(f"`{folder}` cannot be read ({error.strerror or error}). HINT: give this user read access"
                              " to it (permissions, a mounted file system), or point at another folder.") from None


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The newest complete lightning-nd checkpoint in ``folder`` (by save time), or None."""
    if not Path(folder).is_dir():
        raise CheckpointError(f"`{folder}` is not a folder.")
    found = complete_checkpoints(folder)
    return found[0] if found else None


def resume_path(*folders: str | os.PathLike) -> str | None:
    """The newest complete checkpoint in ``folders``, for a script's own ``Trainer.fit(ckpt_path=...)`` (None: start
    fresh). Under `NDParallel`, ``ckpt_path="auto"`` chooses the same on rank 0 for every rank, and falls back to an
    older checkpoint when the newest fails to load."""
    found = complete_checkpoints(*folders)
    return str(found[0]) if found else None
