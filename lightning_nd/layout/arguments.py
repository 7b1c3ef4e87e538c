"""A layout's arguments as a user writes them: `NDParallel(...)`, a Hydra ``parallel`` group
(`NDParallel.from_config`) or the dry run's ``--layout`` and ``--options``. Every route names its keywords from
`KEYWORDS` and checks them with `read_arguments`, in the constructor's order, so the same mistake raises the
same error wherever it is made.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from lightning_nd.layout.options import ParallelConfig
from lightning_nd.layout.validate import check_config
from lightning_nd.mesh.dims import ParallelDims, closest_name

DIM_DEFAULTS = {"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
"""`NDParallel`'s dim keywords, in its order, with their defaults (``dp_shard`` fills the world)."""
DIM_MEANINGS = {
    "dp_replicate": "Copies of the model (HSDP's replicas); each holds every shard FSDP makes inside it.",
    "dp_shard": "Ranks FSDP shards parameters, gradients and optimizer state over; -1 fills the world.",
    "cp": "Context parallelism: ranks each sequence is split over (ring attention).",
    "tp": "Tensor parallelism: ranks each block's layers are split over (+ sequence parallel).",
    "pp": "Pipeline parallelism: ranks the model's blocks are split over, in stages.",
    "ep": "Expert parallelism: ranks a layer's experts are spread over, borrowed from ``dp_shard x cp``.",
}
OPTION_KEYWORDS = tuple(field.name for field in fields(ParallelConfig))
RUNTIME_MEANINGS = {
    "init_on_meta": "Build ``configure_model``'s layers on the meta device and materialise only each rank's shards,"
                    " as plain construction makes the model (ties, the constructor's own init), or refuse the run.",
    "timeout": "Collectives after the first step: a rank waiting longer is reported hung (default 5 min).",
    "init_timeout": "Process-group setup and the first step, which may compile or load (default 20 min).",
    "heartbeat_timeout": "A rank silent this long is dead and every other rank stops with the verdict (default 60 s;"
                         " None: no watchdog).",
    "process_group_backend": "The torch.distributed backend; None: gloo on CPU, nccl on CUDA.",
    "async_save": "Checkpoint saves during fit return once the state is copied to CPU memory; the write and the commit"
                  " go on in the background (at most one in flight; older checkpoints leave once it commits).",
}
"""How the run's processes behave (meta-device init, timeouts, backend, checkpoint saves): no part of the plan."""
RUNTIME_KEYWORDS = tuple(RUNTIME_MEANINGS)
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


def keyword_meanings() -> dict[str, str]:
    """Every keyword of `NDParallel`, in its order, with its meaning: the dims' and the runtime settings' from the
    tables above, the options' from `ParallelConfig`'s field docstrings (read from its source)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(ParallelConfig))).body[0]
    assert isinstance(body, ast.ClassDef)
    options = {}
    for field, doc in zip(body.body, body.body[1:]):
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and isinstance(doc, ast.Expr):
            options[field.target.id] = " ".join(str(ast.literal_eval(doc.value)).split())
    return {**DIM_MEANINGS, **{key: options[key] for key in OPTION_KEYWORDS}, **RUNTIME_MEANINGS}


def arguments_block(indent: str = "    ", width: int = 116) -> str:
    """The ``Arguments:`` block of `NDParallel`'s docstring (Lightning's style), one entry per keyword; a test keeps
    the docstring equal to it, so the two cannot drift."""
    lines = [f"{indent}Arguments:"]
    for key, meaning in keyword_meanings().items():
        lines += textwrap.wrap(f"{key}: {meaning}", width, initial_indent=indent * 2, subsequent_indent=indent * 3)
    return "\n".join(lines)
