"""DCP's reads of a checkpoint folder, checked: the index (``.metadata``) unpickled only through `trusted`'s allow-list
and only when it is DCP's ``Metadata``; every file it names a regular file of the folder; every slice inside its file;
every tensor no bigger than its bytes. DCP itself would ``pickle.load`` the index, fall back to a rank-local
``__<rank>.metadata`` when that fails, follow an absolute path, and allocate what the index claims.

Every DCP read of ours goes through `CheckedReader` (`sharded.py`, `full.py`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata

from lightning_nd.checkpoint import trusted
from lightning_nd.checkpoint.files import DCP_METADATA, CheckpointError, bounded_size, is_plain_name, regular_size

MAX_INDEX_BYTES = 256 << 20


class CheckedReader(FileSystemReader):
    """A ``FileSystemReader`` of one lightning-nd checkpoint folder that gives DCP the folder's ``index``, read and
    checked once by `read_index` (every load of a resume reads the same one)."""

    def __init__(self, folder: Path, index: Metadata) -> None:
        super().__init__(folder)
        self.folder, self.index = Path(folder), index

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback after the index failed: there is no other index
            raise CheckpointError(f"`{self.folder}` has one index, `{DCP_METADATA}`; lightning-nd reads no rank-local"
                                  " one.")
        metadata = self.index
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_index(folder: Path) -> Metadata:
    """``folder``'s DCP index, checked (see the module's docstring); a `CheckpointError` naming what is wrong."""
    file = folder / DCP_METADATA
    bounded_size(file, MAX_INDEX_BYTES)
    metadata = trusted.load_dcp_metadata(file)
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"`{file}` is not DCP's index (it unpickles to a `{type(metadata).__name__}`). HINT: resume"
                              " from another checkpoint.")
    sizes: dict[str, int | None] = {}
    for index, stored in metadata.storage_data.items():
        name = getattr(stored, "relative_path", None)
        where = f"`{file}` names {str(name)[:80]!r} for `{getattr(index, 'fqn', index)}`"
        if not isinstance(name, str) or not is_plain_name(name):
            raise CheckpointError(f"{where}, which is not a file of this folder. HINT: do not load it; resume from"
                                  " another checkpoint.")
        if stored.transform_descriptors:
            raise CheckpointError(f"{where} through {stored.transform_descriptors}, which lightning-nd never writes.")
        if name not in sizes:
            sizes[name] = regular_size(folder / name)
        offset, length, found = stored.offset, stored.length, sizes[name]
        if found is None or not (_count(offset) and _count(length) and offset + length <= found):
            raise CheckpointError(f"{where} at bytes {offset}+{length}, outside the file ({found} bytes, or not a"
                                  " regular file). HINT: resume from another checkpoint.")
    try:
        _check_tensor_sizes(file, metadata)
    except (AttributeError, TypeError) as error:  # an index of DCP's classes holding other things than DCP writes
        raise CheckpointError(f"`{file}` is malformed ({type(error).__name__}: {str(error)[:200]}). HINT: resume from"
                              " another checkpoint.") from None
    return metadata


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_tensor_sizes(file: Path, metadata: Metadata) -> None:
    """Each tensor chunk the index claims fits in the bytes stored for it (DCP allocates what the index says)."""
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        if not isinstance(entry.properties.dtype, torch.dtype):
            raise TypeError(f"the dtype of `{fqn}` is a {type(entry.properties.dtype).__name__}")
        for position, chunk in enumerate(entry.chunks):
            stored = metadata.storage_data.get(MetadataIndex(fqn, chunk.offsets, position))
            if not all(_count(size) for size in chunk.sizes):
                raise TypeError(f"chunk {position} of `{fqn}` has sizes {list(chunk.sizes)[:8]}")
            claimed = math.prod(chunk.sizes) * entry.properties.dtype.itemsize
            if stored is None or claimed > stored.length:
                raise CheckpointError(f"`{file}` claims {claimed} bytes for chunk {position} of `{fqn}`, stored in"
                                      f" {getattr(stored, 'length', 'no')} bytes. HINT: resume from another checkpoint.")
