"""The moments of an `NDParallel` run that are more than a line: the listeners told before the processes start,
the log on rank 0, the mesh's groups announced, the metrics' groups, and what a failing rank says before it
exits. Each takes what it needs (the event bus, the mesh, the Trainer), never the strategy.
"""

from __future__ import annotations

import logging

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_nd.mesh.build import NDMesh
from lightning_nd.mesh.dims import ParallelDims
from lightning_nd.mesh.roles import role_names
from lightning_nd.runtime.errors import out_of_memory_in
from lightning_nd.strategy.events import (
    BeforeProcessGroup,
    EventBus,
    FailureVerdict,
    GroupInfo,
    OutOfMemory,
    ProcessGroupsCreated,
)
from lightning_nd.strategy.quiet import first_time

log = logging.getLogger("lightning_nd")


def before_processes(bus: EventBus, trainer: Trainer, rank: int, world_size: int, backend: str) -> None:
    """Subscribe the Trainer's listening callbacks and tell them the process group is about to start."""
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, undeclared
    for callback in callbacks:
        bus.subscribe(callback)
    if bus.wants(BeforeProcessGroup):
        bus.emit(BeforeProcessGroup(rank, world_size, backend, str(trainer.default_root_dir)))


def processes_started(bus: EventBus, mesh: NDMesh, dims: ParallelDims, rank: int) -> None:
    """Rank 0 logs (one copy of each "Applied ..." line, not one per rank) and shows the mesh, once per process; the listeners hear of
    every mesh role's process group (name, desc, global ranks), and the world's."""
    import torch.distributed as dist

    if rank != 0:
        log.setLevel(logging.WARNING)
    elif not log.hasHandlers():
        log.addHandler(logging.StreamHandler())
        log.setLevel(logging.INFO)
    table = f"lightning-nd mesh {dims.as_dict()}\n{dims.rank_table()}"
    if first_time(table):  # not again at each `validate`, `test` or `predict` of the same mesh
        rank_zero_info(table)
    if not bus.wants(ProcessGroupsCreated):
        return
    world = dist.group.WORLD
    assert world is not None
    groups = [GroupInfo(world.group_name, world.group_desc, "world", tuple(range(dist.get_world_size())))]
    for role in role_names(dims):
        for dim, group in zip(mesh[role].mesh_dim_names or (role,), mesh[role].get_all_groups()):
            name = role if mesh[role].ndim == 1 else f"{role}.{dim}"
            groups.append(GroupInfo(group.group_name, group.group_desc, name,
                                    tuple(dist.get_process_group_ranks(group))))
    bus.emit(ProcessGroupsCreated(tuple(groups)))


def sync_metrics_over_batch_ranks(module: nn.Module, group: object) -> None:
    """torchmetrics' metrics reduce over the ranks that saw different samples (tp ranks share theirs)."""
    from torchmetrics import Metric

    for child in module.modules():
        if isinstance(child, Metric) and child.process_group is None:
            child.process_group = group


def trainer_of(module: LightningModule | None) -> Trainer | None:
    """The Trainer the module is attached to, if any (a failure may come before or after)."""
    return module.trainer if module is not None and module._trainer is not None else None


def out_of_memory(bus: EventBus, rank: int, exception: BaseException, trainer: Trainer | None) -> None:
    """An out-of-memory error (CUDA's, or the CPU allocator's), also one a wrapper re-raised (a pipeline stage's),
    becomes an `OutOfMemory` event first, with the allocator's own message."""
    found = out_of_memory_in(exception)
    if found is not None:
        stage = str(trainer.state.stage.value) if trainer is not None and trainer.state.stage else None
        bus.emit(OutOfMemory(rank, (str(found).strip().splitlines() or [type(found).__name__])[0][:500], stage))


def deliver_verdict(bus: EventBus, verdict: FailureVerdict, trainer: Trainer | None) -> None:
    """The failure verdict reaches the listeners, then the loggers are flushed, before the process exits."""
    bus.emit(verdict)
    for logger in trainer.loggers if trainer is not None else ():
        try:
            logger.save()
            flush = getattr(getattr(logger, "experiment", None), "flush", None)
            if callable(flush):
                flush()
        except Exception:  # flushing is best effort: the process is going down anyway
            log.debug("lightning-nd: could not flush %s", type(logger).__name__)
