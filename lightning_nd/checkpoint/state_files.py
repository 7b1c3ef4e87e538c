"""The files of a checkpoint besides DCP's: Lightning's state without the weights and each rank's random states.

Written as JSON (`json_state.py`, format 2); a checkpoint of format 1 holds them as pickles (``meta.pt``,
``rng-<R>.pt``), read through `trusted`'s allow-list. Both are bounded in size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_nd.checkpoint import trusted
from lightning_nd.checkpoint.files import LEGACY_META, META, CheckpointError, regular_size, rng_file
from lightning_nd.checkpoint.json_state import NotEncodable, encode, read_json, write_json

MAX_META_BYTES = 256 << 20
MAX_RNG_BYTES = 16 << 20
KEEPABLE = ("a str, a number, a bool, None, a list, a tuple, a dict, a tensor, a path or an omegaconf config")


def not_keepable(error: NotEncodable) -> CheckpointError:
    return CheckpointError(
        f"{error}, which a checkpoint could keep only as code (a pickle runs code when it is read). HINT: keep it out"
        f" (`self.save_hyperparameters(ignore=[...])`, or a callback's `state_dict()` without it), or make it {KEEPABLE}."
    )


def check_keepable(value: Any, where: str) -> None:
    """Refuse, before a run trains, a state its checkpoints could not keep (`json_state.encode`)."""
    try:
        encode(value, where)
    except NotEncodable as error:
        raise not_keepable(error) from None


def write_meta(folder: Path, meta: dict[str, Any]) -> None:
    try:
        write_json(folder / META, meta, "the checkpoint's state")
    except NotEncodable as error:
        raise not_keepable(error) from None


def write_rng(folder: Path, rank: int, rng: dict[str, Any]) -> None:
    write_json(folder / rng_file(rank), rng, "the random state")


def read_meta(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Lightning's state of the checkpoint folder ``path`` (its ``manifest`` says the format)."""
    if manifest.get("format", 0) < 2:
        _bounded(path / LEGACY_META, MAX_META_BYTES)
        meta = trusted.load_meta(path / LEGACY_META)
    else:
        meta = read_json(path / META, MAX_META_BYTES)
    if not isinstance(meta, dict):
        raise CheckpointError(f"`{path}`'s state is a {type(meta).__name__}, not a dict. HINT: resume from another"
                              " checkpoint.")
    return meta


def read_rng(path: Path, manifest: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """``rank``'s random states in the checkpoint folder ``path``, or None when it holds none for that rank."""
    legacy = manifest.get("format", 0) < 2
    name = rng_file(rank, legacy=legacy)
    if name not in manifest["files"]:
        return None
    if legacy:
        _bounded(path / name, MAX_RNG_BYTES)
        rng = trusted.load_rng(path / name)
    else:
        rng = read_json(path / name, MAX_RNG_BYTES)
    if not isinstance(rng, dict):
        raise CheckpointError(f"`{path / name}` is a {type(rng).__name__}, not random states. HINT: resume from another"
                              " checkpoint.")
    return rng


def _bounded(file: Path, limit: int) -> None:
    size = regular_size(file)
    if size is None or size > limit:
        raise CheckpointError(f"`{file}` is not a regular file of at most {limit} bytes. HINT: resume from another"
                              " checkpoint.")
