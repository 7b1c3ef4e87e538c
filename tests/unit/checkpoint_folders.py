"""One-rank checkpoint folders written without processes, as `save_sharded` writes them (format 2: JSON state), or as
lightning-nd wrote them up to format 1 (pickled state, read through the allow-list)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from lightning_nd.checkpoint import files
from lightning_nd.checkpoint.commit import commit
from lightning_nd.checkpoint.state_files import write_meta, write_rng

RUN = "test-run"


def one_rank_checkpoint(path: Path, state: dict[str, Any], meta: dict[str, Any], rng: Any = None, legacy: bool = False,
                        info: dict[str, Any] | None = None) -> None:
    staging = staged(path, state, meta, rng, legacy)
    info = {"world_size": 1, **(info or {})}
    if not legacy:
        commit(staging, path, files.own_files(staging, 0), info, run=RUN)
        return
    listed = {p.name: {"rank": 0, "bytes": p.stat().st_size, "crc32": files.crc32(p)} for p in staging.iterdir()}
    (staging / files.MANIFEST).write_text(json.dumps({"format": 1, "saved_at": time.time(), "files": listed, **info}))
    staging.rename(path)


def staged(path: Path, state: dict[str, Any], meta: dict[str, Any], rng: Any = None, legacy: bool = False) -> Path:
    """Every file of the checkpoint written into this run's staging folder, the manifest not yet."""
    import torch.distributed.checkpoint as dcp

    staging = files.staging_path(path, RUN)
    shutil.rmtree(staging, ignore_errors=True)  # a save of this run that was cut short, as `begin_save` removes it
    staging.mkdir(parents=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(staging), no_dist=True)
    rng = rng if rng is not None else {"torch": torch.get_rng_state()}
    if legacy:
        torch.save(rng, staging / files.rng_file(0, legacy=True))
        torch.save(meta, staging / files.LEGACY_META)
    else:
        write_rng(staging, 0, rng)
        write_meta(staging, meta)
    return staging
