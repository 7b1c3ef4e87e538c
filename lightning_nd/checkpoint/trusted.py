"""A checkpoint folder's pickles are read as data: nothing in a file runs as code.

The rule: each pickle lightning-nd reads from a checkpoint folder may name only the classes and functions its
writers put there (the tables below, found on files real runs wrote); a file naming any other is refused with
`CheckpointError`, naming the file and those names, before any of them is called. The pickles: Lightning's remaining
state (``meta.pt``), each rank's random state (``rng-<R>.pt``), DCP's index (``.metadata``, which DCP itself reads
with a plain ``pickle.load``) and the non-tensor values in DCP's shards (optimizer hyper-parameters, which DCP reads
with ``torch.load(weights_only=False)``). Types the user trusts are added the way torch's own loader takes them:
``torch.serialization.add_safe_globals([Color])`` before loading a ``meta.pt`` whose hyper-parameters hold the
project's own ``Color`` enum.

``meta.pt`` is not read with ``torch.load(weights_only=True)``: that unpickler sets items only into plain dicts, and
the config ``@hydra.main`` hands the task keeps Hydra's ``now`` resolver cache in a ``collections.defaultdict``, so a
checkpoint whose hyper-parameters hold the Hydra config could not be read at all. Instead ``torch.load`` gets
`_unpickler`'s allow-list as its ``pickle_module`` (tensors are still rebuilt by torch, from the file's storages).
"""

from __future__ import annotations

import functools
import io
import pickle
import types
from pathlib import Path
from typing import Any

import torch

from lightning_nd.checkpoint.files import CheckpointError

HINT = ("HINT: a checkpoint you did not write can run code through these; do not load it. If you wrote it yourself"
        " and trust it, allow them with `torch.serialization.add_safe_globals([...])` before loading")


def named(*objects: Any) -> dict[str, Any]:
    return {f"{obj.__module__}.{obj.__qualname__}": obj for obj in objects}


def builtin_types(*kinds: type) -> dict[str, Any]:
    """``torch.save`` writes pickle protocol 2, which names builtins as Python 2 did (``__builtin__.long``)."""
    python2 = {int: "long", str: "unicode"}
    return {f"{module}.{kind.__name__}": kind for kind in kinds for module in ("builtins", "__builtin__")} | {
        f"__builtin__.{python2[kind]}": kind for kind in kinds if kind in python2}


def tensor_globals() -> dict[str, Any]:
    from collections import OrderedDict

    return named(torch._utils._rebuild_tensor_v2, OrderedDict)


def latin1_encode(text: str, encoding: str = "latin1", errors: str = "strict") -> bytes:
    """``_codecs.encode`` as pickle protocol 2 uses it (bytes written as latin-1 text), and only so: any other
    encoding can grow its input, and a few nested calls in a 2 KB file asked for 16 GB."""
    if encoding not in ("latin1", "latin-1", "iso-8859-1") or not isinstance(text, str):
        raise Refused(f"_codecs.encode of a {type(text).__name__} to {str(encoding)[:20]!r}")
    return text.encode("latin1", errors)


LATIN1 = {"_codecs.encode": latin1_encode}


@functools.cache
def rng_globals() -> dict[str, Any]:
    """Lightning's ``_collect_rng_states``: torch's generator states, numpy's ``get_state()`` (an ndarray), Python's."""
    import numpy

    reconstruct = numpy.empty(0).__reduce__()[0]  # the function that rebuilds an ndarray, under this numpy's name
    return tensor_globals() | named(numpy.ndarray, numpy.dtype, reconstruct) | LATIN1 | {
        "numpy.core.multiarray._reconstruct": reconstruct}  # its name before numpy 2


@functools.cache
def meta_globals() -> dict[str, Any]:
    """Lightning's checkpoint dict without the weights: loops', callbacks' and schedulers' state (plain values and
    tensors), and hyper-parameters, which may hold paths and Hydra's configs (omegaconf containers with their nodes
    and metadata, and the types those record: ``typing.Any``, ``int``, ``dict``...)."""
    import collections
    import pathlib
    import typing

    from omegaconf import DictConfig, ListConfig, base, nodes

    omegaconf = (DictConfig, ListConfig, base.Metadata, base.ContainerMetadata, nodes.AnyNode, nodes.StringNode,
                 nodes.IntegerNode, nodes.FloatNode, nodes.BooleanNode, nodes.BytesNode, nodes.PathNode, nodes.EnumNode)
    paths = (pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath)
    return (tensor_globals() | named(*omegaconf, *paths, collections.defaultdict, typing.Any)
            | {"typing.Dict": typing.Dict, "typing.List": typing.List}  # noqa: UP006 (the names omegaconf records)
            | builtin_types(dict, list, int, float, str, bool, bytes) | LATIN1)


@functools.cache
def dcp_metadata_globals() -> dict[str, Any]:
    """DCP's ``Metadata``: per entry its chunks, dtype, layout and memory format, and where each chunk is stored."""
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    dcp = (metadata.Metadata, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
           metadata.ChunkStorageMetadata, metadata.TensorProperties, metadata.MetadataIndex, metadata.StorageMeta,
           metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo)
    dtypes = {f"torch.{name}": value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
    return named(*dcp, torch.Size, torch.serialization._get_layout, pathlib.PosixPath, pathlib.WindowsPath) | dtypes


class Refused(pickle.UnpicklingError):
    """A name outside the file's allow-list; the message is the name."""


def user_trusted() -> dict[str, Any]:
    """What the user allowed with ``torch.serialization.add_safe_globals`` (an object, or an (object, name) pair)."""
    trusted: dict[str, Any] = {}
    for entry in torch.serialization.get_safe_globals():
        trusted |= {entry[1]: entry[0]} if isinstance(entry, tuple) else named(entry)
    return trusted


def _unpickler(allowed: dict[str, Any]) -> type[pickle.Unpickler]:
    class AllowListed(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            # NOTE: looked up, never imported: a name outside the table reaches no module's code.
            if (found := allowed.get(f"{module}.{name}")) is None:
                raise Refused(f"{module}.{name}")
            return found

    return AllowListed


def _refusal(file: Path | str, names: set[str], hint: str = "") -> CheckpointError:
    shown = ", ".join(f"`{name}`" for name in sorted(names))
    return CheckpointError(f"`{file}` holds {shown}, which lightning-nd does not unpickle from a checkpoint (only the"
                           f" types Lightning, Hydra and DCP write there). {HINT}{hint}.")


def _torch_load(file: Path, table: dict[str, Any], hint: str = "", **options: Any) -> Any:
    allowed = table | user_trusted()
    unpickler = _unpickler(allowed)
    module = types.SimpleNamespace(__name__=__name__, Unpickler=unpickler,
                                   load=lambda handle, **options: unpickler(handle, **options).load())
    try:  # weights_only=False only because `module` is the check (see the module's docstring)
        return torch.load(file, weights_only=False, pickle_module=module, **options)
    except Refused as refused:  # every name the file holds outside the table, not only the first one met
        try:
            others = set(torch.serialization.get_unsafe_globals_in_checkpoint(file)) - set(allowed)
        except Exception:  # noqa: BLE001 - a file torch cannot list: the one name met is enough
            others = set()
        raise _refusal(file, {str(refused), *others}, hint) from None
    except Exception as error:  # noqa: BLE001 - truncated, garbled, or asking for more memory than there is
        raise CheckpointError(f"`{file}` cannot be read ({type(error).__name__}: {str(error)[:200]}). HINT: resume"
                              " from another checkpoint.") from None


def load_meta(file: Path) -> dict[str, Any]:
    """``meta.pt``: Lightning's checkpoint without the weights and optimizer states."""
    return _torch_load(file, meta_globals(), " (usually your own classes in `save_hyperparameters` or a callback's"
                       " state: `save_hyperparameters(ignore=[...])` keeps them out of new checkpoints)")


def load_whole(file: Path) -> dict[str, Any]:
    """A one-file checkpoint (an export, or any Lightning checkpoint): ``meta.pt``'s types, with the weights and the
    optimizer states as tensors; mapped, not read, as every rank reads it whole."""
    return _torch_load(file, meta_globals(), " (usually your own classes in `save_hyperparameters` or a callback's"
                       " state)", mmap=True, map_location="cpu")


def load_rng(file: Path) -> dict[str, Any]:
    """``rng-<R>.pt``: one rank's random generators' states."""
    return _torch_load(file, rng_globals())


def load_dcp_metadata(file: Path) -> Any:
    """DCP's index (``.metadata``, which DCP itself reads with a plain ``pickle.load``) through the allow-list."""
    allowed = dcp_metadata_globals() | user_trusted()
    with open(file, "rb") as handle:
        try:
            return _unpickler(allowed)(handle).load()
        except Refused as refused:
            raise _refusal(file, {str(refused)}) from None
        except Exception as error:  # noqa: BLE001 - a truncated or garbled pickle: one line, not a traceback
            raise CheckpointError(f"`{file}` is corrupt ({type(error).__name__}: {str(error)[:200]}). HINT: resume"
                                  " from another checkpoint.") from None


def check_value(value: io.BytesIO, key: str, folder: Path) -> None:
    """A non-tensor value in DCP's shards (an optimizer's ``lr``, ``betas``...): ``torch.load``'s own allow-list."""
    try:
        torch.load(value, weights_only=True)
    except pickle.UnpicklingError:
        value.seek(0)
        names = torch.serialization.get_unsafe_globals_in_checkpoint(value)
        shown = ", ".join(f"`{name}`" for name in names) or "what `torch.load(weights_only=True)` refuses"
        raise CheckpointError(f"The value of `{key}` in the shards of `{folder}` holds {shown}, which lightning-nd does"
                              f" not unpickle from a checkpoint. {HINT}.") from None
    value.seek(0)


@functools.cache
def _checked(planner: type) -> type:
    class Checked(planner):
        """DCP reads non-tensor values with ``torch.load(weights_only=False)``: each is checked first."""

        def __init__(self, folder: Path, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.folder = folder

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            check_value(value, read_item.dest_index.fqn, self.folder)
            super().load_bytes(read_item, value)

    return Checked


def load_planner(folder: Path, whole: bool = False) -> Any:
    """DCP's load planner for ``folder`` (``whole``: the one that reads every entry, for `read_sharded`), checking
    each non-tensor value before DCP unpickles it."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    return _checked(_EmptyStateDictLoadPlanner if whole else DefaultLoadPlanner)(folder)



def refusal_in(error: BaseException) -> CheckpointError | None:
    """DCP wraps each rank's failure in a ``CheckpointException`` (with tracebacks): the refusal among them, if any."""
    failures = getattr(error, "failures", {}).values()
    return next((failure for failure, _ in failures if isinstance(failure, CheckpointError)), None)
