"""Rank 0's last step of a save: the manifest, then the folder into place, so that at every instant the name holds a
complete checkpoint (the old one or the new one) and a crash at any point leaves at least the checkpoints that were
there before.

Order: every file written and flushed (DCP with ``sync_files``, ``meta.json`` and the RNG files by `json_state`), the
manifest written and flushed, the staging folder flushed; then the swap, and the parent folder flushed. Replacing an
existing checkpoint swaps the two folders in one step (Linux's ``renameat2(RENAME_EXCHANGE)``) and removes the old one
after. Where the file system cannot (some network file systems), the old folder is first renamed to a hidden
``.<name>.replaced``, which a listing takes for the checkpoint of that name until the new one is in place
(`listing.py`), then the new one is renamed into place.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from lightning_nd.checkpoint.files import FORMAT_VERSION, MANIFEST
from lightning_nd.checkpoint.listing import REPLACED
from lightning_nd.runtime.job import run_key

AT_FDCWD, RENAME_EXCHANGE = -100, 2


def commit(staging: Path, path: Path, files: dict[str, dict[str, int]], info: dict[str, Any],
           run: str | None = None) -> None:
    """Rank 0, once every rank has written into ``staging``: the manifest last, then the folder into place as
    ``path``."""
    manifest = {"format": FORMAT_VERSION, "saved_at": time.time(), "run": run if run is not None else run_key(),
                "files": files, **info}
    with open(staging / MANIFEST, "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    sync_folder(staging)
    if path.is_symlink() or path.is_file():  # `ModelCheckpoint(save_last="link")`'s link: it names a whole one anyway
        path.unlink()
    if path.is_dir():
        _replace(staging, path)
    else:
        os.rename(staging, path)
    sync_folder(path.parent)


def _replace(staging: Path, path: Path) -> None:
    if exchange(staging, path):
        sync_folder(path.parent)
        shutil.rmtree(staging)  # the old checkpoint, now under the staging name
        return
    replaced = path.parent / f".{path.name}{REPLACED}"
    shutil.rmtree(replaced, ignore_errors=True)  # `path` is there: an earlier replaced copy is out of date
    os.rename(path, replaced)
    sync_folder(path.parent)
    os.rename(staging, path)
    sync_folder(path.parent)
    shutil.rmtree(replaced)


def exchange(first: Path, second: Path) -> bool:
    """Swap two folders in one step; False where the system or the file system cannot (nothing changed then)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not Linux, or a C library before glibc 2.28
        return False
    if renameat2(AT_FDCWD, os.fsencode(first), AT_FDCWD, os.fsencode(second), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(code, f"swapping `{first}` and `{second}`: {os.strerror(code)}")


def sync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename in it survives a power cut)."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
