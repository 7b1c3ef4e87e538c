"""Typed schemas of `conf/`, registered in Hydra's ConfigStore: a typo or a wrong type fails when Hydra composes the
config, naming the key (``parallel.tp_sise=2``: "Key 'tp_sise' not in 'ParallelSchema'"), before any process starts.

Each schema mirrors the arguments of what its group builds, read from their signatures, so it cannot drift from
them: ``parallel`` -> `lightning_nd.NDParallel`, ``trainer`` -> Lightning's ``Trainer``, ``data`` ->
`examples.data.TokenDataModule`, ``model`` -> the example model's config (``llama_schema``, ``gpt_schema``: one per
model, chosen by the model file's own defaults list), ``diagnostics`` -> the main job's monitors. OmegaConf 2.3 types
a field int, float, bool, str, a list or dict of them, or Any: an argument of another type (``timedelta | float``,
``bool | str``, a ``Literal``) becomes the plain type its values take in a config file (`plain_type`), and the
argument checks its own values when it is built.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from lightning_nd.runtime.job import run_key

CONF = Path(__file__).resolve().parents[1] / "conf"
"""The main job's config folder."""
SIMPLE = (int, float, bool, str)
SET_BY_THE_JOB = ("strategy", "logger", "callbacks")
"""Trainer arguments `examples/train.py` builds itself (from ``parallel``, ``log_dir``, ``checkpoint``, the
monitors)."""


def plain_type(hint: Any) -> Any:
    """``hint`` as OmegaConf can hold it: simple types and their Optional, lists and dicts of them; else Any."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in SIMPLE:
        return hint
    if origin is Literal:
        kinds = {type(arg) for arg in args}
        return kinds.pop() if len(kinds) == 1 and next(iter(kinds)) in SIMPLE else Any
    if origin in (Union, types.UnionType):
        kinds = [arg for arg in args if arg is not type(None)]
        if kinds == [timedelta, float] or set(kinds) == {timedelta, float}:
            inner = float  # seconds
        elif len(kinds) == 1:
            inner = plain_type(kinds[0])
        else:
            return Any
        return Optional[inner] if type(None) in args and inner is not Any else inner  # noqa: UP045 (OmegaConf)
    if origin in (list, Sequence, tuple) and args and plain_type(args[0]) in SIMPLE:
        return list[plain_type(args[0])]
    if origin in (dict, Mapping) and args and args[0] is str:
        value = plain_type(args[1])
        return dict[str, value if value in SIMPLE else Any]
    return Any


def _default(value: Any) -> Any:
    if value is inspect.Parameter.empty:
        return MISSING  # required: composing without it fails
    if isinstance(value, timedelta):
        return value.total_seconds()
    return value


def mirror(name: str, function: Callable[..., Any], skip: tuple[str, ...] = (), extra: Sequence[tuple] = ()) -> type:
    """A dataclass with a field per keyword of ``function`` (its hints made plain, its defaults kept)."""
    hints = typing.get_type_hints(function)
    fields: list[tuple] = list(extra)
    for parameter in inspect.signature(function).parameters.values():
        if parameter.name in ("self", *skip) or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        kind, default = plain_type(hints.get(parameter.name, Any)), _default(parameter.default)
        if isinstance(default, (list, dict)):
            fields.append((parameter.name, kind, dataclasses.field(default_factory=lambda d=default: d)))
        else:
            fields.append((parameter.name, kind, dataclasses.field(default=default)))
    return dataclasses.make_dataclass(name, fields)


def model_mirror(name: str, config: type) -> type:
    """The example model's config dataclass, plus the ``name`` `examples/train.py` picks the model by."""
    hints = typing.get_type_hints(config)
    return dataclasses.make_dataclass(name, [("name", str, dataclasses.field(default=MISSING))] + [
        (f.name, plain_type(hints[f.name]), dataclasses.field(default=f.default)) for f in dataclasses.fields(config)])


@dataclasses.dataclass
class DiagnosticsSchema:
    """The main job's monitors (`diagnostics.all_monitors`); `conf/diagnostics/*.yaml` set them."""

    enabled: bool = True
    collectives: bool = True
    distributed_debug: Optional[str] = None  # noqa: UP045 (OmegaConf 2.3 reads Optional, not X | None)
    collectives_every_n_steps: int = 10
    memory: bool = True
    memory_every_n_steps: int = 10
    bottleneck: bool = True
    bottleneck_every_n_steps: int = 10
    routing: bool = True
    routing_every_n_steps: int = 10
    profile: Optional[str] = None  # noqa: UP045


@dataclasses.dataclass
class SearchSchema:
    """``parallel=search`` (`examples/search.py`): the planner's layouts, the first ``budget`` measured. Always
    present (off), so ``search.*`` overrides compose in a sweep whose other jobs are layouts."""

    enabled: bool = False
    budget: int = 4
    steps: int = 6
    timeout_s: float = 600.0
    global_batch: Optional[int] = None  # noqa: UP045
    memory: Optional[str] = None  # noqa: UP045
    profile: str = "host"


def schemas() -> dict[str, type]:
    """Group -> schema (``model`` -> the schema per model name)."""
    from lightning.pytorch import Trainer

    from examples.data import TokenDataModule
    from examples.models.gpt import GPTConfig
    from examples.models.llama import LlamaConfig
    from lightning_nd import NDParallel

    return {"parallel": mirror("ParallelSchema", NDParallel.__init__),
            "trainer": mirror("TrainerSchema", Trainer.__init__, skip=SET_BY_THE_JOB),
            "data": mirror("DataSchema", TokenDataModule.__init__),
            "llama_schema": model_mirror("LlamaSchema", LlamaConfig),
            "gpt_schema": model_mirror("GPTSchema", GPTConfig),
            "diagnostics": DiagnosticsSchema}


def register() -> None:
    """Put the schemas in Hydra's ConfigStore: ``config_schema`` (the primary config's, every group typed but the
    model) and ``model/llama_schema``, ``model/gpt_schema`` (each model file's defaults list names its own)."""
    if not OmegaConf.has_resolver("run_key"):  # `hydra.run.dir`: one folder per job, whoever started it (job.py)
        OmegaConf.register_new_resolver("run_key", run_key, use_cache=True)
    found = schemas()
    top = [(group, found[group], dataclasses.field(default_factory=found[group]))
           for group in ("parallel", "trainer", "data", "diagnostics")]
    store = ConfigStore.instance()
    store.store(name="config_schema", node=dataclasses.make_dataclass("ConfigSchema", [
        *top, ("model", Any, dataclasses.field(default=None)), ("seed", int, 0), ("lr", float, 3e-3),
        ("log_dir", str, dataclasses.field(default=MISSING)),
        ("checkpoint", dict[str, Any], dataclasses.field(default_factory=dict)),
        ("ckpt_path", Optional[str], None),  # noqa: UP045
        ("search", SearchSchema, dataclasses.field(default_factory=SearchSchema))]))
    for name in ("llama_schema", "gpt_schema"):
        store.store(group="model", name=name, node=found[name])


def compose(overrides: list[str], conf: Path = CONF, return_hydra_config: bool = False) -> DictConfig:
    """The main job's config with ``overrides``, typed by the schemas (registered here), as ``examples/train.py``
    gets it but without running anything: for the tests, the planner's benchmarks and a notebook
    (``return_hydra_config``: with Hydra's own node, its launcher's settings among them)."""
    register()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=return_hydra_config)
