"""Lightning's state without the weights (``meta.json``) and each rank's random states (``rng-<R>.json``) as JSON: a
format that cannot carry code, read back to the same values.

JSON's own values stay as they are (floats include infinities, as Python's ``json`` writes them); the others are tagged
objects, ``{"$type": ...}``: tuples, sets, dicts with other keys than strings (or a ``$type`` key), tensors and numpy
arrays (dtype, shape and their bytes in base64), numpy scalars, paths, and omegaconf configs (as YAML, read back with
omegaconf's safe loader). Anything else (a class of the user's in the hyper-parameters, a function) has no such form:
`encode` refuses it naming where it is, and a run is refused before it trains (`state_files.check_keepable`).

Reading is bounded: the file's size, the nesting (Python's parser and this decoder stop at their recursion limit), and
each tensor's bytes, which must be exactly its shape's.
"""

from __future__ import annotations

import base64
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

import numpy
import torch

from lightning_nd.checkpoint.files import CheckpointError, bounded_size

TAG = "$type"
TORCH_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}
NUMPY_DTYPES = ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8",
                "bool")


class NotEncodable(TypeError):
    """A value with no code-free form; ``where`` names it inside the state."""

    def __init__(self, where: str, value: object) -> None:
        super().__init__(f"{where} is a `{type(value).__module__}.{type(value).__qualname__}`")
        self.where = where


def encode(value: Any, where: str = "the state") -> Any:
    """``value`` as JSON values (tagged objects for what JSON lacks); `NotEncodable` for what has no code-free form."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [encode(item, f"{where}[{index}]") for index, item in enumerate(value)]
        if isinstance(value, list):
            return items
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return {TAG: "tuple", "items": items}
        if isinstance(value, (set, frozenset)):
            return {TAG: "set", "items": items}
    if isinstance(value, Mapping) and not _is_omegaconf(value):
        if all(isinstance(key, str) for key in value) and TAG not in value:
            return {key: encode(item, f"{where}[{key!r}]") for key, item in value.items()}
        return {TAG: "dict", "items": [[encode(key, f"{where} key"), encode(item, f"{where}[{key!r}]")]
                                       for key, item in value.items()]}
    if isinstance(value, torch.Tensor) and str(value.dtype).removeprefix("torch.") in TORCH_DTYPES:
        whole = value.detach().cpu().contiguous()
        data = whole.reshape(-1).view(torch.uint8)
        return {TAG: "tensor", "dtype": str(whole.dtype).removeprefix("torch."), "shape": list(whole.shape),
                "data": base64.b64encode(data.numpy().tobytes()).decode()}
    if isinstance(value, numpy.ndarray) and value.dtype.name in NUMPY_DTYPES:
        return {TAG: "ndarray", "dtype": value.dtype.name, "shape": list(value.shape),
                "data": base64.b64encode(numpy.ascontiguousarray(value).tobytes()).decode()}
    if isinstance(value, numpy.generic) and value.dtype.name in NUMPY_DTYPES:
        return {TAG: "numpy", "dtype": value.dtype.name, "value": value.item()}
    if isinstance(value, PurePath):
        return {TAG: "path", "value": str(value)}
    if _is_omegaconf(value):
        return {TAG: "omegaconf", "yaml": _yaml(value)}
    raise NotEncodable(where, value)


def _yaml(config: Any) -> str:
    """Resolved, as Lightning saves ``hparams.yaml`` (a resolver such as Hydra's ``now`` may be missing when the
    checkpoint is read); as it is where an interpolation cannot be resolved here."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_yaml(config, resolve=True)
    except Exception:  # noqa: BLE001 - omegaconf's resolution errors have no common base but Exception
        return OmegaConf.to_yaml(config)


def _is_omegaconf(value: Any) -> bool:
    return any(cls.__module__.startswith("omegaconf.") and cls.__name__ in ("DictConfig", "ListConfig")
               for cls in type(value).__mro__)


def decode(value: Any, where: str = "the state") -> Any:
    """What `encode` wrote, back; a tagged object of another shape is refused (`ValueError`) naming where."""
    if isinstance(value, list):
        return [decode(item, f"{where}[{index}]") for index, item in enumerate(value)]
    if not isinstance(value, dict):
        return value
    if TAG not in value:
        return {key: decode(item, f"{where}[{key!r}]") for key, item in value.items()}
    kind = value[TAG]
    if kind in ("tuple", "set", "dict"):
        items = _field(value, "items", list, where)
        if kind == "dict":
            if not all(isinstance(pair, list) and len(pair) == 2 for pair in items):
                raise ValueError(f"{where}: a dict's items are not [key, value] pairs")
            return {_hashable(decode(key, f"{where} key"), where): decode(item, f"{where}[{key!r}]")
                    for key, item in items}
        decoded = [decode(item, f"{where}[{index}]") for index, item in enumerate(items)]
        return tuple(decoded) if kind == "tuple" else {_hashable(item, where) for item in decoded}
    if kind in ("tensor", "ndarray"):
        return _array(value, kind, where)
    if kind == "numpy":
        dtype = _field(value, "dtype", str, where)
        if dtype not in NUMPY_DTYPES or isinstance(value.get("value"), (dict, list, str)) or value.get("value") is None:
            raise ValueError(f"{where}: not a numpy scalar")
        return numpy.dtype(dtype).type(value["value"])
    if kind == "path":
        return Path(_field(value, "value", str, where))
    if kind == "omegaconf":
        from omegaconf import OmegaConf

        return OmegaConf.create(_field(value, "yaml", str, where))
    raise ValueError(f"{where}: unknown `{TAG}` {str(kind)[:40]!r}")


def _field(value: dict, name: str, kind: type, where: str) -> Any:
    found = value.get(name)
    if not isinstance(found, kind):
        raise ValueError(f"{where}: `{name}` is not a {kind.__name__}")  # noqa: TRY004 - a malformed file, said as one
    return found


def _hashable(value: Any, where: str) -> Any:
    try:
        hash(value)
    except TypeError:
        raise ValueError(f"{where}: a key or set item that is a {type(value).__name__}") from None
    return value


def _array(value: dict, kind: str, where: str) -> Any:
    dtype, shape, data = _field(value, "dtype", str, where), _field(value, "shape", list, where), _field(
        value, "data", str, where)
    if dtype not in (TORCH_DTYPES if kind == "tensor" else NUMPY_DTYPES):
        raise ValueError(f"{where}: a {kind} of dtype {dtype[:40]!r}")
    if not all(isinstance(size, int) and not isinstance(size, bool) and 0 <= size for size in shape):
        raise ValueError(f"{where}: a {kind} of shape {str(shape)[:80]}")
    raw = base64.b64decode(data, validate=True)
    itemsize = TORCH_DTYPES[dtype].itemsize if kind == "tensor" else numpy.dtype(dtype).itemsize
    if len(raw) != math.prod(shape) * itemsize:
        raise ValueError(f"{where}: a {kind} of shape {shape} holds {len(raw)} bytes, not {math.prod(shape) * itemsize}")
    if kind == "ndarray":
        return numpy.frombuffer(raw, dtype=dtype).copy().reshape(shape)
    if not raw:  # no bytes to view
        return torch.empty(shape, dtype=TORCH_DTYPES[dtype])
    return torch.from_numpy(numpy.frombuffer(raw, dtype=numpy.uint8).copy()).view(TORCH_DTYPES[dtype]).reshape(shape)


def write_json(file: Path, value: Any, where: str) -> None:
    """``value`` encoded into ``file``, flushed to disk (a checkpoint's manifest is written after it)."""
    text = json.dumps(encode(value, where))
    with open(file, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def read_json(file: Path, limit: int) -> Any:
    """``file`` decoded; anything wrong with it (too big, not JSON, too deep, malformed) is one `CheckpointError`."""
    bounded_size(file, limit)
    try:
        return decode(json.loads(file.read_bytes()), f"`{file.name}`")
    except (ValueError, RecursionError, MemoryError, OverflowError) as error:
        raise CheckpointError(f"`{file}` is malformed ({type(error).__name__}: {str(error)[:300]}). HINT: resume from"
                              " another checkpoint.") from None
