"""`Checkpointer`: what `NDParallel`'s checkpoint hooks call, on `lightning_nd.checkpoint`.

Lightning asks the strategy for the model's and optimizers' state, then hands the whole checkpoint to
``save_checkpoint``; ``load_checkpoint`` loads model and optimizers in place and returns the rest
(loops, schedulers) for Lightning to restore. Both run under the long (start-up) timeout. What is saved or loaded
comes from the strategy as one `CheckpointedRun`: this rank's model and optimizers, the Trainer, the dims and
the Layout.

With ``async_save``, a save during a running fit returns once the state is staged and commits in the background
(`lightning_nd.checkpoint.async_save`); the next save, a removal of an older checkpoint and the end of training wait
for that commit (the removal in the background), and each training step looks whether it has landed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from torch import nn
from torch.optim import Optimizer

from lightning_nd.checkpoint.async_save import AsyncSaver, SaveInFlight
from lightning_nd.checkpoint.files import CheckpointError
from lightning_nd.checkpoint.full import load_full
from lightning_nd.checkpoint.names import Names, group_names, model_state, optimizer_state
from lightning_nd.checkpoint.sharded import gather, load_sharded, save_sharded
from lightning_nd.checkpoint.state_files import check_keepable
from lightning_nd.layout.record import Layout
from lightning_nd.mesh.dims import ParallelDims
from lightning_nd.strategy.data_position import DataPosition, resume_loader
from lightning_nd.strategy.events import CheckpointCommitted, CheckpointLoaded, CheckpointSaved, EventBus
from lightning_nd.strategy.failure_monitor import FailureMonitor

log = logging.getLogger("lightning_nd")
AFTER_FAILURE_WAIT_S = 30.0
"""How long the end of a failed run waits for the save in flight to commit before it gives it up."""


@dataclass(frozen=True)
class CheckpointedRun:
    """What a checkpoint is saved from and loaded into."""

    model: nn.Module
    optimizers: Sequence[Optimizer]
    trainer: Trainer
    dims: ParallelDims
    layout: Layout | None


def names_of(layout: Layout | None) -> Names:
    """How the model's parameters are named in a checkpoint: whole-model names, also under pp."""
    plan = layout.pipeline if layout is not None else None
    return Names(plan.attribute, plan.units(), plan.split.tied) if plan is not None else Names()


class Checkpointer:
    """Save: a folder of shards per rank under whole-model names (any layout can load it). Load: that
    folder, or one file of whole tensors (an export, or any Lightning checkpoint)."""

    def __init__(self, bus: EventBus, failures: FailureMonitor, run: Callable[[], CheckpointedRun],
                 broadcast: Callable[[str], str], async_save: bool = False) -> None:
        """``run``: what is saved or loaded, asked at each call; ``broadcast``: rank 0's value on every rank."""
        self.bus, self.failures, self._run, self._broadcast = bus, failures, run, broadcast
        self._saver = AsyncSaver(failures.init_timeout) if async_save else None
        self._data_position: DataPosition | None = None
        self._layout_change = ""  # how the layout changed since the loaded checkpoint, said when the loader starts
        self._pending_rng: dict[str, Any] | None = None
        self.last_checkpoint: Path | None = None

    def resume_hint(self) -> str:
        last = self.last_checkpoint
        return f" HINT: resume with `Trainer.fit(..., ckpt_path={str(last)!r})`." if last else ""

    def check_keepable(self, trainer: Trainer) -> None:
        """Before a fit trains: what its checkpoints will hold besides tensors (hyper-parameters, callbacks' state) has a
        code-free form (`state_files.check_keepable`), so a save hours in is not the first to refuse it."""
        module, datamodule = trainer.lightning_module, getattr(trainer, "datamodule", None)
        check_keepable(dict(module.hparams), f"`{type(module).__name__}`'s hyper-parameter")
        if datamodule is not None and hasattr(datamodule, "hparams"):
            check_keepable(dict(datamodule.hparams), f"`{type(datamodule).__name__}`'s hyper-parameter")
        callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, undeclared
        for callback in callbacks:
            check_keepable(callback.state_dict(), f"`{type(callback).__name__}`'s state")

    def model_state(self) -> dict[str, Any]:
        run = self._run()
        return model_state(run.model, names_of(run.layout))

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        run = self._run()
        return optimizer_state(run.model, _unwrapped(optimizer), names_of(run.layout))

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("`NDParallel.save_checkpoint(..., storage_options=...)` is not supported: it writes with"
                            " torch.distributed.checkpoint, not a `CheckpointIO` plugin.")
        start = time.perf_counter()
        run, path = self._run(), Path(self._broadcast(str(filepath)))
        state = {"model": checkpoint.pop("state_dict")}
        optimizer_states = checkpoint.pop("optimizer_states", [])  # none when saving weights only
        state.update({f"optimizer_{i}": s for i, s in enumerate(optimizer_states)})
        checkpoint["lightning_nd"] = info = _layout_info(run, len(optimizer_states))
        step = checkpoint.get("global_step")
        self.wait_for_save()  # at most one in flight
        if self._saver is None or run.trainer.state.status != TrainerStatus.RUNNING:  # no end of fit would wait for it
            with self.failures.long_timeout():
                save_sharded(path, state, checkpoint, _collect_rng_states(), info | {"global_step": step})
            self.last_checkpoint = path
            self.bus.emit(CheckpointSaved(str(path), step, time.perf_counter() - start))
            return
        with self.failures.long_timeout():
            in_flight = self._saver.save(path, state, checkpoint, _collect_rng_states(), info | {"global_step": step}, step)
        self._saver.keep_timeout()  # its write may take as long as a synchronous save's, which the long timeout covers
        in_flight.after_commit(lambda: self._landed(path))
        self.bus.emit(CheckpointSaved(str(path), step, time.perf_counter() - start, committed=False))

    def _landed(self, path: Path) -> None:
        self.last_checkpoint = path  # in the commit thread: the resume hint names it before any older one is removed

    def remove(self, remove: Callable[[], None]) -> None:
        """Remove an older checkpoint (`ModelCheckpoint`'s top-k) now, or once the save in flight has committed (in
        the background; never if it fails), so a crash meanwhile leaves the older one the newest complete one."""
        in_flight = self._saver.in_flight if self._saver is not None else None
        if in_flight is None:
            remove()
        else:
            in_flight.after_commit(remove)

    def poll_save(self) -> None:
        """Deliver `CheckpointCommitted` if the save in flight has committed (no waiting, no collective)."""
        if self._saver is not None and (save := self._saver.poll()) is not None:
            self._committed(save)

    def wait_for_save(self, timeout: float | None = None) -> None:
        """Wait for the save in flight to commit; raises `CheckpointError` if it failed."""
        if self._saver is not None and (save := self._saver.wait(timeout)) is not None:
            self._committed(save)

    def end_saves(self) -> None:
        """At the end of a stage: the save in flight commits first. After a failure, wait at most
        ``AFTER_FAILURE_WAIT_S`` and raise nothing (the run's own error is the one to tell)."""
        if self._saver is None or self._saver.in_flight is None:
            return
        if self._run().trainer.state.status != TrainerStatus.INTERRUPTED:
            self.wait_for_save()
            return
        try:
            self.wait_for_save(AFTER_FAILURE_WAIT_S)
        except (TimeoutError, CheckpointError) as error:
            reason = str(error) or f"not within {AFTER_FAILURE_WAIT_S:.0f} s"
            log.warning(f"lightning-nd: the checkpoint being saved when the run failed did not commit ({reason}); the"
                        " one before it is the newest complete one.")

    def _committed(self, save: SaveInFlight) -> None:
        landed = save.committed.result()
        self.bus.emit(CheckpointCommitted(str(save.path), save.step, landed - save.started))

    def load(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load model and optimizers in place; returns the rest of the checkpoint for Lightning to restore."""
        start = time.perf_counter()
        run, path = self._run(), Path(self._broadcast(str(checkpoint_path)))
        dims, world_size = run.dims, dist.get_world_size()
        strict = run.trainer.lightning_module.strict_loading
        names, optimizers = names_of(run.layout), [_unwrapped(o) for o in run.optimizers]
        with self.failures.long_timeout():
            if path.is_file():
                meta, rng = load_full(path, run.model, optimizers, names, strict, weights_only), None
            else:
                meta, rng = load_sharded(path, run.model, optimizers, names, strict=strict)
        saved = meta.get("lightning_nd", {})
        same_layout = saved.get("layout") == dims.as_dict() and saved.get("world_size") == world_size
        resharded = saved.get("layout", dims.as_dict()) != dims.as_dict()
        self.bus.emit(CheckpointLoaded(str(path), resharded, time.perf_counter() - start))
        fitting = run.trainer.state.fn == TrainerFn.FITTING
        if resharded and not fitting:
            log.info(f"lightning-nd: resharded `{path}` from {saved['layout']} on {saved['world_size']} ranks to"
                     f" {dims.as_dict()} on {world_size}")
        if not fitting:
            return meta  # validate/test/predict: the weights are all they take
        self._layout_change = ""
        if rng is not None and same_layout:
            self._pending_rng = rng  # set as training resumes: starting the data loader draws from it first
        elif "layout" in saved and not same_layout:  # said once, with the global batch, when the loader starts
            self._layout_change = (
                f"`{path}` was saved under {saved['layout']} on {saved['world_size']} ranks; this run is"
                f" {dims.as_dict()} on {world_size} ranks: resharded, and dropout and sampling continue from this run's"
                " seeds (the saved random state is per rank of that layout).")
        else:
            log.warning(f"lightning-nd: `{path}` has no random state for this layout ({dims.as_dict()} on"
                        f" {world_size} ranks); dropout and sampling continue from this run's seeds.")
        self._data_position = DataPosition.from_dict(saved["data"]) if "data" in saved else None
        return meta

    def before_training_step(self) -> None:
        """A resumed run's random state is set now: starting the data loader drew from it first."""
        if self._pending_rng is not None:
            _set_rng_states(self._pending_rng)
        self._pending_rng = self._data_position = None  # every training loader has been set up by now

    def resumed_loader(self, dataloader: Any) -> Any:
        if self._data_position is None and not self._layout_change:
            return dataloader
        run = self._run()
        if run.trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        changed, self._layout_change = self._layout_change, ""
        return resume_loader(dataloader, self._data_position, run.dims.batch_size_multiplier, run.trainer, changed,
                             speak=dist.get_rank() == 0)


def _layout_info(run: CheckpointedRun, saved_optimizers: int) -> dict[str, Any]:
    """The layout, the data position, and each saved optimizer group's parameter names over all ranks."""
    names = names_of(run.layout)
    local = [group_names(run.model, _unwrapped(optimizer), names) for optimizer in run.optimizers[:saved_optimizers]]
    everywhere: list[list[list[list[str]]]] = gather(local)
    param_names = []
    for index in range(len(local)):
        groups = [rank_groups[index] for rank_groups in everywhere]
        param_names.append([names.whole_model_order(_merged([g[i] for g in groups])) for i in range(len(groups[0]))])
    return {"layout": run.dims.as_dict(), "world_size": dist.get_world_size(), "param_names": param_names,
            "data": DataPosition.of(run.trainer, run.dims.batch_size_multiplier).as_dict()}


def _unwrapped(optimizer: Optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _merged(lists: list[list[str]]) -> list[str]:
    """One list of names from every rank's (replicas repeat names; pipeline ranks hold others), first seen first."""
    seen: dict[str, None] = {}
    for names in lists:
        seen.update(dict.fromkeys(names))
    return list(seen)
