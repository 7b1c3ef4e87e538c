"""What `Trainer(devices=N, strategy=NDParallel(**arguments)).fit(module)` checks before its first step, in the
same order and with the same functions, without the strategy, Lightning or a process group: the arguments
(`read_layout_arguments`), the dims against the world size and the model (`plan_for`), and a batch's shape
(`check_batch_shape`). The planner plans every candidate layout through `dry_run`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_nd.context_parallel.sharding import shard_batch
from lightning_nd.layout.arguments import LayoutArguments, read_arguments, split_arguments
from lightning_nd.layout.plan import PlanMemo, plan_layout
from lightning_nd.layout.record import Layout
from lightning_nd.layout.validate import check_config, check_sequence_lengths
from lightning_nd.mesh.dims import ParallelDims
from lightning_nd.pipeline_parallel.schedules import check_microbatches
from lightning_nd.runtime.probe import model_to_check
from lightning_nd.runtime.timeouts import DEFAULTS, check_timeouts


def parse_layout(text: str) -> dict[str, Any]:
    """``tp=8,pp=4,dp_shard=2`` -> ``{"tp": 8, "pp": 4, "dp_shard": 2}``. A value is read as JSON (``tp=2.0`` is the
    float 2.0, which the dims then refuse as `NDParallel(tp=2.0)` would); an unknown dim names the closest."""
    sizes: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        ParallelDims.check_names([name])
        if not value:
            raise ValueError(f"`--layout {text}`: `{part}` needs a size. HINT: e.g. `{name}=2`.")
        try:
            sizes[name] = json.loads(value)
        except json.JSONDecodeError:
            sizes[name] = value
    return sizes


def read_layout_arguments(arguments: Mapping[str, Any]) -> LayoutArguments:
    """`NDParallel.from_config(arguments)`'s checks, in its order (keywords, timeouts, sizes, options), without
    building the strategy."""
    sizes, options, runtime = split_arguments(arguments)
    check_timeouts(*(runtime.get(name, default) for name, default in DEFAULTS.items()))
    return read_arguments(sizes, options)


def plan_for(arguments: LayoutArguments, devices: int, module: nn.Module | None, *, precision: str | None = None,
             gpus_per_node: int | None = None, memo: PlanMemo | None = None,
             init_on_meta: bool = True) -> Layout | None:
    """What `Trainer(devices=devices, strategy=...)` checks when built, then what ``connect(module)`` plans
    (None without a module). ``memo``: `plan_layout`'s, for repeated plans of one module; ``init_on_meta``: as
    `NDParallel`'s (a model `configure_model` builds on the meta device is checked as materialising needs it)."""
    dims = ParallelDims(**arguments.sizes, world_size=devices)  # as the strategy makes them for the launcher
    check_config(dims.as_dict(), arguments.config)
    if module is None:
        return None
    # The planner plans one module many times: its `configure_model` copy is built and checked once.
    probe = (model_to_check(module, on_meta=init_on_meta) if memo is None else
             memo.get(("probe", init_on_meta), lambda: model_to_check(module, on_meta=init_on_meta)))
    if probe is None:
        raise ValueError(f"`{type(module).__name__}.configure_model` needs the running job (the device mesh), so"
                         " its model cannot be built before launch. HINT: plan a factory of the model itself.")
    return plan_layout(probe, dims, arguments.config, precision=precision, local_world_size=gpus_per_node or devices,
                       memo=memo)


def dry_run(module: nn.Module, devices: int, sizes: Mapping[str, Any], options: Mapping[str, Any], *,
            precision: str | None = None, gpus_per_node: int | None = None, seq_len: int | None = None,
            micro_batch: int | None = None, memo: PlanMemo | None = None) -> Layout:
    """The Layout `Trainer(devices=devices, strategy=NDParallel(**sizes, **options)).fit(module)` makes, after
    every check it makes first. ``module``: the LightningModule (or a `Holder` of the model); ``memo``:
    `plan_layout`'s `PlanMemo`, kept by a caller that plans the same module many times."""
    layout = plan_for(read_layout_arguments({**sizes, **options}), devices, module, precision=precision,
                      gpus_per_node=gpus_per_node, memo=memo, init_on_meta=options.get("init_on_meta", True))
    assert layout is not None
    if seq_len is not None:
        check_batch_shape(layout, seq_len, micro_batch or 1)
    return layout


def check_batch_shape(layout: Layout, seq_len: int, micro_batch: int) -> None:
    """The checks the strategy makes when a batch of this shape arrives (token ids [micro_batch, seq_len])."""
    dims = layout.dims
    batch = {"input_ids": torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")}
    if dims["cp"] > 1:
        batch, _ = shard_batch(batch, dims["cp"], 0, None)
    if layout.options.sequence_parallel:
        check_sequence_lengths(batch, dims["tp"])
    if dims["pp"] > 1:
        check_microbatches(batch, layout.options.pp_microbatches)
