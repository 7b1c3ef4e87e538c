"""The one JSON codec of every record: `to_dict` / `to_json` write a record as plain JSON values, `from_dict` /
`from_json` read them back as the same record, guided by its fields' types (nested records, tuples, ``int`` keys).

Reading is lenient the way old files need: a key the record does not know is ignored, a missing one takes the
field's default, or None where the field may be None; anything else missing raises ``KeyError``. It is strict about
what is there (the files may come from anywhere): an ``int`` field takes an integer (a string of digits as a key), a
``float`` a finite number, a ``str`` a string, a list a list; else ``TypeError``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from collections.abc import Mapping
from functools import cache
from typing import TYPE_CHECKING, Any, TypeVar, Union, get_args, get_origin, get_type_hints

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Record = TypeVar("Record", bound="DataclassInstance")


def to_dict(value: object) -> Any:
    """A record (or anything holding records) as plain JSON-able values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_dict(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_dict(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_dict(v) for k, v in value.items()}
    return value


def to_json(record: object, indent: int | None = 1) -> str:
    return json.dumps(to_dict(record), indent=indent)


def from_dict(cls: type[Record], values: Any) -> Record:
    """The ``cls`` record that `to_dict` wrote as ``values``."""
    if not isinstance(values, Mapping):
        raise TypeError(f"`{cls.__name__}` is read from a JSON object, not from {type(values).__name__}")
    hints = _field_types(cls)
    given: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name in values:
            given[field.name] = _decode(hints[field.name], values[field.name])
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            if type(None) not in get_args(hints[field.name]):
                raise KeyError(field.name)
            given[field.name] = None
    return cls(**given)


def from_json(cls: type[Record], text: str) -> Record:
    return from_dict(cls, json.loads(text))


@cache
def _field_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _decode(hint: Any, value: Any) -> Any:
    """``value`` as JSON holds it, as the field type ``hint`` wants it."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        kinds = [kind for kind in args if kind is not type(None)]
        if len(kinds) != 1:
            raise TypeError(f"a record field is one type or that type | None, not {hint}")
        return _decode(kinds[0], value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_dict(hint, value)
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise TypeError(f"a list was expected, not {type(value).__name__}")
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            decoded = [_decode(args[0], item) for item in value]
            return decoded if origin is list else tuple(decoded)
        return tuple(_decode(kind, item) for kind, item in zip(args, value, strict=True))
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"an object was expected, not {type(value).__name__}")
        return {_decode(args[0], key): _decode(args[1], item) for key, item in value.items()}
    if hint in SCALARS:
        return SCALARS[hint](value)
    return value  # Any, Literal: as JSON holds them


def _int(value: Any) -> int:
    """An int of at most 30 digits (a thread id is 20), or such a string (JSON keys are strings: ``{"3": "node-a"}`` is
    rank 3's host)."""
    if isinstance(value, str) and value.lstrip("-").isdigit() and len(value) <= 31:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not -(10**30) < value < 10**30:
        raise ValueError(f"an integer was expected, not {str(value)[:40]!r}")
    return value


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"a finite number was expected, not {str(value)[:40]!r}")
    return float(value)


def _of(kind: type) -> Any:
    def check(value: Any) -> Any:
        if not isinstance(value, kind):
            raise TypeError(f"a {kind.__name__} was expected, not {type(value).__name__}")
        return value

    return check


SCALARS = {int: _int, float: _float, str: _of(str), bool: _of(bool)}
