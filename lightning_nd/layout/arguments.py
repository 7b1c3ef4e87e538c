"""A layout's arguments as a user writes them: `NDParallel(...)`, a Hydra ``parallel`` group
(`NDParallel.from_config`) or the dry run's ``--layout`` and ``--options``. Every route names its keywords from
`KEYWORDS` and checks them with `read_arguments`, in the constructor's order, so the same mistake raises the
same error wherever it is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from lightning_nd.layout.dims import ParallelDims, closest_name
from lightning_nd.layout.options import ParallelConfig
from lightning_nd.layout.validate import check_config

DIM_DEFAULTS = {"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
"""`NDParallel`'s dim keywords, in its order, with their defaults (``dp_shard`` fills the world)."""
OPTION_KEYWORDS = tuple(field.name for field in fields(ParallelConfig))
RUNTIME_KEYWORDS = ("init_on_meta", "timeout", "init_timeout", "heartbeat_timeout", "process_group_backend")
"""How the run's processes behave (meta-device init, timeouts, backend): no part of the plan."""
KEYWORDS = (*DIM_DEFAULTS, *OPTION_KEYWORDS, *RUNTIME_KEYWORDS)


@dataclass(frozen=True)
class LayoutArguments:
    """What a layout asks for before the world size is known: each dim's size (-1: fill) and the options."""

    sizes: dict[str, int]
    config: ParallelConfig


def check_keywords(arguments: Mapping[str, Any]) -> None:
    """An unknown keyword names the closest valid one."""
    for key in arguments:
        if key not in KEYWORDS:
            raise ValueError(f"`NDParallel` has no option `{key}`. HINT: did you mean"
                             f" `{closest_name(key, KEYWORDS)}`? Options: {', '.join(KEYWORDS)}.")


def read_arguments(sizes: Mapping[str, Any], options: Mapping[str, Any]) -> LayoutArguments:
    """The checks `NDParallel`'s constructor makes after its timeouts: each size alone, the options alone, then
    the options against the sizes (world size still unknown)."""
    sizes = {**DIM_DEFAULTS, **sizes}
    ParallelDims.check_sizes(sizes)
    config = ParallelConfig(**options)
    check_config(sizes, config)
    return LayoutArguments(sizes, config)


def split_arguments(arguments: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(dim sizes, options, runtime settings) of a flat mapping of `NDParallel` keywords."""
    check_keywords(arguments)
    kinds = (tuple(DIM_DEFAULTS), OPTION_KEYWORDS, RUNTIME_KEYWORDS)
    sizes, options, runtime = ({key: value for key, value in arguments.items() if key in kind} for kind in kinds)
    return sizes, options, runtime
