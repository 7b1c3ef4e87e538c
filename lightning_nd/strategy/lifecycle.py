"""The moments of an `NDParallel` run that several hooks share: starting the processes, the mesh's groups,
the layout made public, the step context, and what a failing rank says before it exits.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from lightning_nd.layout.roles import role_names
from lightning_nd.layout.tp_plan import custom_styles
from lightning_nd.parallel.compose import ParallelizeReport, parallelize
from lightning_nd.parallel.fsdp import fsdp_root
from lightning_nd.parallel.context.region import context_parallel_region
from lightning_nd.strategy.events import (
    BeforeProcessGroup,
    FailureVerdict,
    GroupInfo,
    LayoutReady,
    OUT_OF_MEMORY_WORDS,
    OutOfMemory,
    ProcessGroupsCreated,
)

log = logging.getLogger("lightning_nd")

LAYOUT_FILE = "layout.json"
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def start_processes(strategy: Any) -> None:
    """Subscribe the Trainer's listening callbacks, tell them the process group is about to start, start it."""
    trainer = strategy.lightning_module.trainer
    for callback in trainer.callbacks:
        strategy.events.subscribe(callback)
    if strategy.events.wants(BeforeProcessGroup):
        strategy.events.emit(BeforeProcessGroup(strategy.global_rank, strategy.world_size,
                                                strategy._get_process_group_backend(), str(trainer.default_root_dir)))
    strategy._setup_distributed()
    if strategy.global_rank != 0:  # one copy of each "Applied ..." line, not one per rank
        log.setLevel(logging.WARNING)
    elif not log.hasHandlers():
        log.addHandler(logging.StreamHandler())
        log.setLevel(logging.INFO)


def groups_created(strategy: Any) -> None:
    """Every mesh role's process group (name, desc, global ranks), and the world's."""
    import torch.distributed as dist

    if not strategy.events.wants(ProcessGroupsCreated):
        return
    mesh = strategy.device_mesh
    groups = [GroupInfo(dist.group.WORLD.group_name, dist.group.WORLD.group_desc, "world",
                        tuple(range(dist.get_world_size())))]
    for role in role_names(strategy.dims):
        for dim, group in zip(mesh[role].mesh_dim_names or (role,), mesh[role].get_all_groups()):
            name = role if mesh[role].ndim == 1 else f"{role}.{dim}"
            groups.append(GroupInfo(group.group_name, group.group_desc, name,
                                    tuple(dist.get_process_group_ranks(group))))
    strategy.events.emit(ProcessGroupsCreated(tuple(groups)))


def layout_ready(strategy: Any, trainer: Any) -> None:
    """Hand the Layout to the listeners and the pre-flight, and write it as ``layout.json`` into the run's log dir
    (rank 0)."""
    layout = strategy.layout
    if strategy.events.wants(LayoutReady):
        strategy.events.emit(LayoutReady(layout))
    strategy.preflight.layout_ready(strategy)
    log_dir = trainer.log_dir if trainer.loggers else None  # a collective: every rank asks
    if strategy.global_rank == 0 and log_dir:
        path = Path(log_dir) / LAYOUT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(layout.to_json(indent=1))


def parallelize_model(strategy: Any) -> ParallelizeReport:
    """Apply the Layout to the LightningModule (the composer: `parallel/compose.py`)."""
    # FSDP2 warns when a wrapped module returns a view; the root unit returns logits that are views of the
    # head's output on every step. Only the root unit's warning is silenced.
    root_class = type(fsdp_root(strategy.model)).__name__
    warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \(FSDP{root_class}\) returned a view tensor")
    styles = custom_styles(strategy.model, strategy.config.tp_plan) if strategy.dims.tp > 1 else None
    return parallelize(strategy.model, strategy.device_mesh, strategy.layout, forward_methods=STEP_METHODS,
                       styles=styles)


def sync_metrics_over_batch_ranks(strategy: Any) -> None:
    from torchmetrics import Metric

    group = strategy.device_mesh.group("batch")
    for module in strategy.lightning_module.modules():
        if isinstance(module, Metric) and module.process_group is None:
            module.process_group = group


def step_context(strategy: Any, forward: bool = True) -> ExitStack:
    """What a step (``forward``) and its backward run inside: loss parallel, and the context-parallel region."""
    stack = ExitStack()
    if strategy.config.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        stack.enter_context(loss_parallel())
    if strategy._cp_positions is not None:
        stack.enter_context(context_parallel_region(strategy.device_mesh.group("cp"), strategy._cp_positions,
                                                    expect_attention=forward, report=strategy.step_events.report("cp")))
    return stack


def out_of_memory(strategy: Any, exception: BaseException) -> None:
    """An out-of-memory error (CUDA's, or the CPU allocator's) becomes an `OutOfMemory` event first."""
    text = str(exception).lower()
    if isinstance(exception, torch.OutOfMemoryError) or any(words in text for words in OUT_OF_MEMORY_WORDS):
        trainer = strategy.lightning_module.trainer if strategy.lightning_module is not None else None
        stage = str(trainer.state.stage.value) if trainer is not None and trainer.state.stage else None
        strategy.events.emit(OutOfMemory(strategy.global_rank, str(exception).splitlines()[0][:500], stage))


def deliver_verdict(strategy: Any, culprit: int, reason: str, thread: str, communication: bool = False) -> None:
    """The failure verdict reaches the listeners, then the loggers are flushed, before the process exits."""
    strategy.events.emit(FailureVerdict(culprit, reason, strategy.global_rank, thread, communication))
    module = strategy.lightning_module
    for logger in (module.trainer.loggers if module is not None and module._trainer is not None else ()):
        try:
            logger.save()
            experiment = getattr(logger, "experiment", None)
            if callable(getattr(experiment, "flush", None)):
                experiment.flush()
        except Exception:  # flushing is best effort: the process is going down anyway
            log.debug("lightning-nd: could not flush %s", type(logger).__name__)
