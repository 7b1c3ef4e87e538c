"""A checkpoint on disk: a folder that appears whole or not at all, and says what it must contain.

Every rank writes into a hidden ``.<name>.<run>.partial`` folder next to the final path (one per run, so two jobs
saving one name never touch each other's). Once all have written, rank 0 writes the manifest (each file, who wrote it,
its size and CRC32, the run that wrote it) and swaps the folder into place (`commit.py`). A save cut short leaves only
the hidden folder, which no search for checkpoints matches.

Checkpoint folders are read as files from strangers: the manifest is a bounded JSON document of a fixed shape, every
file it lists is a plain name inside the folder and a regular file (no link, device or pipe), and a folder whose
files disagree with it is refused with the missing piece named.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import stat
import time
import zlib
from pathlib import Path
from typing import Any

MANIFEST = "lightning_nd.json"
META = "meta.json"
LEGACY_META = "meta.pt"  # format 1: Lightning's state pickled, read through `trusted`'s allow-list
DCP_METADATA = ".metadata"
FORMAT_VERSION = 2
MAX_MANIFEST_BYTES = 64 << 20
PLAIN_NAME = re.compile(r"[A-Za-z0-9_.=+-]{1,255}")
"""A file of a checkpoint: one name in its folder (no separator, not ``.`` or ``..``)."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: incomplete, truncated, corrupt, crafted, or from another model."""


class CheckpointMismatch(CheckpointError):
    """A readable checkpoint of another model (other tensors, other shapes, other optimizers): an older checkpoint of
    the same run would not fit either, so resuming never falls back past it."""


def staging_path(path: Path, run: str) -> Path:
    """Where ``run`` writes ``path`` before it is whole."""
    return path.parent / f".{path.name}.{re.sub(r'[^A-Za-z0-9_-]+', '_', run)}.partial"


def stale_stagings(path: Path, idle_s: float) -> list[Path]:
    """Other runs' staging folders of ``path`` nothing was written into for ``idle_s`` seconds (a save that died; a
    save in progress writes its files all along)."""
    now, found = time.time(), []
    for staging in path.parent.glob(f".{glob.escape(path.name)}.*.partial"):
        try:
            newest = max([staging.lstat().st_mtime, *(entry.lstat().st_mtime for entry in staging.iterdir())])
        except OSError:  # removed meanwhile, or unreadable: not ours to remove
            continue
        if now - newest > idle_s:
            found.append(staging)
    return found


def rng_file(rank: int, legacy: bool = False) -> str:
    return f"rng-{rank}.pt" if legacy else f"rng-{rank}.json"


def is_plain_name(name: object) -> bool:
    return isinstance(name, str) and bool(PLAIN_NAME.fullmatch(name)) and name not in (".", "..")


def regular_size(file: Path) -> int | None:
    """The size of ``file`` if it is a regular file (not a link, a device or a pipe), else None."""
    try:
        found = os.lstat(file)
    except OSError:
        return None
    return found.st_size if stat.S_ISREG(found.st_mode) else None


def said(error: Exception, path: Path | None = None) -> str:
    """What a rank tells the others of its failure, in one line: a `CheckpointError`'s own words, else its type and
    message (naming ``path`` when given)."""
    if isinstance(error, CheckpointError):
        return str(error)
    return f"{f'`{path}`: ' if path else ''}{type(error).__name__}: {error}"


def bounded_size(file: Path, limit: int) -> int:
    """The size of ``file``, a regular file of at most ``limit`` bytes; else a `CheckpointError` saying so."""
    size = regular_size(file)
    if size is None or size > limit:
        raise CheckpointError(f"`{file}` is not a regular file of at most {limit} bytes"
                              f" ({'none' if size is None else f'{size} bytes'}). HINT: resume from another checkpoint.")
    return size


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


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint folder ``path``, checked to be one (its shape, its file names)."""
    if not path.exists():
        raise CheckpointError(f"There is no checkpoint at `{path}`.")
    if not path.is_dir():
        raise CheckpointError(f"`{path}` is a file, not a sharded lightning-nd checkpoint folder.")
    manifest_path = path / MANIFEST
    size = regular_size(manifest_path)
    if size is None:
        missing = not manifest_path.exists() and not manifest_path.is_symlink()
        raise CheckpointError(
            f"`{path}` has no `{MANIFEST}`: its save never finished (a rank died or the job was stopped while writing),"
            " or it was not written by lightning-nd. HINT: resume from an older checkpoint." if missing else
            f"`{manifest_path}` is not a regular file (a link, a device or a pipe). HINT: resume from another checkpoint.")
    if size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"`{manifest_path}` has {size} bytes, more than a manifest's {MAX_MANIFEST_BYTES}."
                              " HINT: resume from another checkpoint.")
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except OSError as error:
        raise CheckpointError(f"`{manifest_path}` cannot be read ({error.strerror or error}). HINT: give this user read"
                              " access to the checkpoint (permissions, a mounted file system), or resume from another"
                              " checkpoint.") from None
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"`{manifest_path}` is corrupt ({type(error).__name__}: {str(error)[:200]}). HINT: resume"
                              " from an older checkpoint.") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"`{manifest_path}` is not a manifest (a JSON {type(manifest).__name__}, not an object)."
                              " HINT: resume from another checkpoint.")
    version = manifest.get("format", 0)
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise CheckpointError(f"`{path}` was written by a newer lightning-nd (format {version}, this one reads"
                              f" {FORMAT_VERSION}). HINT: upgrade lightning-nd.")
    if wrong := _malformed(manifest):
        raise CheckpointError(f"`{manifest_path}` is malformed: {wrong}. HINT: resume from another checkpoint.")
    return manifest


def _malformed(manifest: dict[str, Any]) -> str | None:
    """What is wrong with the manifest's shape, or None."""
    def count(value: object, low: int = 0, high: float = math.inf) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and low <= value < high

    if not count(manifest.get("format", 0)):
        return f"`format` is {manifest.get('format')!r}"
    saved_at = manifest.get("saved_at")
    if isinstance(saved_at, bool) or not isinstance(saved_at, (int, float)) or not math.isfinite(saved_at):
        return f"`saved_at` is {saved_at!r}, not a time"
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not listed:
        return "`files` lists no file"
    for name, entry in listed.items():
        if not is_plain_name(name):
            return f"it lists {str(name)[:80]!r}, which is not a file of this folder (a path, or a name with a separator)"
        if not (isinstance(entry, dict) and count(entry.get("rank")) and count(entry.get("bytes"))
                and count(entry.get("crc32"), 0, 1 << 32)):
            return f"the entry of `{name}` is {str(entry)[:80]}, not a rank, a size and a CRC32"
    if manifest.get("global_step") is not None and not count(manifest["global_step"]):
        return f"`global_step` is {manifest['global_step']!r}"
    if not isinstance(manifest.get("run", ""), str):
        return f"`run` is {manifest['run']!r}"
    return None


def problems(path: Path, manifest: dict[str, Any], names: list[str] | None = None, checksum: bool = True) -> list[str]:
    """What is wrong with the files (``names``, default all) the manifest lists: missing, not a regular file,
    truncated, corrupt."""
    found = []
    for name in names if names is not None else sorted(manifest["files"]):
        entry, file = manifest["files"][name], path / name
        writer = f"written by rank {entry['rank']}"
        size = regular_size(file)
        if size is None:
            there = file.exists() or file.is_symlink()
            found.append(f"`{name}` ({writer}) " + ("is not a regular file (a link, a device or a pipe)" if there
                                                    else "is missing"))
        elif size != entry["bytes"]:
            change = "truncated" if size < entry["bytes"] else "grown or replaced since"
            found.append(f"`{name}` ({writer}) has {size} bytes, {entry['bytes']} were written ({change})")
        elif checksum and crc32(file) != entry["crc32"]:
            found.append(f"`{name}` ({writer}) does not match its checksum (corrupt)")
    return found


def raise_problems(path: Path, found: list[str]) -> None:
    if found:
        raise CheckpointError(f"Checkpoint `{path}` cannot be loaded: " + "; ".join(found)
                              + ". HINT: resume from an older checkpoint.")


def is_complete(path: Path) -> bool:
    """Whole as far as a quick look tells: a manifest, and every file it lists present at its size."""
    try:
        return not problems(path, read_manifest(path), checksum=False)
    except CheckpointError:
        return False
