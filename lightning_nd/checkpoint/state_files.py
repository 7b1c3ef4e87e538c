"""The files of a checkpoint besides DCP's: Lightning's state without the weights and each rank's random states.

Written as JSON (`json_state.py`, format 2); a checkpoint of format 1 holds them as pickles (``meta.pt``,
``rng-<R>.pt``), read through `trusted`'s allow-list. Both are bounded in size.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_nd.checkpoint import trusted
from lightning_nd.checkpoint.files import LEGACY_META, META, CheckpointError, bounded_size, rng_file
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
    legacy = manifest.get("format", 0) < 2
    return _read_dict(path / (LEGACY_META if legacy else META), legacy, trusted.load_meta, MAX_META_BYTES, "state")


def read_rng(path: Path, manifest: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """``rank``'s random states in the checkpoint folder ``path``, or None when it holds none for that rank."""
    legacy = manifest.get("format", 0) < 2
    name = rng_file(rank, legacy=legacy)
    if name not in manifest["files"]:
        return None
    return _read_dict(path / name, legacy, trusted.load_rng, MAX_RNG_BYTES, "random states")


def _read_dict(file: Path, legacy: bool, load_legacy: Callable[[Path], Any], limit: int, what: str) -> dict[str, Any]:
    """A dict from ``file``: format 1's pickle through the allow-list (``load_legacy``), else JSON; both bounded."""
    if legacy:
        bounded_size(file, limit)
        value = load_legacy(file)
    else:
        value = read_json(file, limit)
    if not isinstance(value, dict):
        raise CheckpointError(f"`{file}` is a {type(value).__name__}, not the checkpoint's {what}. HINT: resume from"
                              " another checkpoint.")
    return value
