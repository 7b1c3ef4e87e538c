"""`Checkpointer`: what `NDParallel`'s checkpoint hooks call, on `lightning_nd.checkpoint`.

Lightning asks the strategy for the model's and optimizers' state, then hands the whole checkpoint to
``save_checkpoint``; ``load_checkpoint`` loads model and optimizers in place and returns the rest
(loops, schedulers) for Lightning to restore. Both run under the long (start-up) timeout.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.optim import Optimizer

from lightning_nd.checkpoint.full import load_full
from lightning_nd.checkpoint.names import Names, group_names, model_state, optimizer_state
from lightning_nd.checkpoint.sharded import gather, load_sharded, save_sharded
from lightning_nd.strategy.data_position import DataPosition, resume_loader
from lightning_nd.strategy.events import CheckpointLoaded, CheckpointSaved

log = logging.getLogger("lightning_nd")


class Checkpointer:
    """Save: a folder of shards per rank under whole-model names (any layout can load it). Load: that
    folder, or one file of whole tensors (an export, or any Lightning checkpoint). ``strategy``: the
    `NDParallel` it serves (its model, optimizers, dims, collectives and failure monitor)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self._data_position: DataPosition | None = None
        self._pending_rng: dict[str, Any] | None = None
        self.last_checkpoint: Path | None = None

    def _names(self) -> Names:
        layout = self.strategy.layout_or_none
        plan = layout.pipeline if layout is not None else None
        return Names(plan.attribute, plan.units(), plan.split.tied) if plan is not None else Names()

    def model_state(self) -> dict[str, Any]:
        assert self.strategy.model is not None
        return model_state(self.strategy.model, self._names())

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.strategy.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return optimizer_state(self.strategy.model, optimizer, self._names())

    def save(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        start = time.perf_counter()
        path = Path(self.strategy.broadcast(str(filepath)))
        state = {"model": checkpoint.pop("state_dict")}
        optimizer_states = checkpoint.pop("optimizer_states", [])  # none when saving weights only
        state.update({f"optimizer_{i}": s for i, s in enumerate(optimizer_states)})
        checkpoint["lightning_nd"] = info = self._layout_info(len(optimizer_states))
        with self.strategy.failures.long_timeout():
            save_sharded(path, state, checkpoint, _collect_rng_states(), info | {"global_step": checkpoint.get("global_step")})
        self.last_checkpoint = path
        self.strategy.events.emit(CheckpointSaved(str(path), checkpoint.get("global_step"), time.perf_counter() - start))

    def load(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load model and optimizers in place; returns the rest of the checkpoint for Lightning to restore."""
        start = time.perf_counter()
        strategy = self.strategy
        path = Path(strategy.broadcast(str(checkpoint_path)))
        model, module, dims = strategy.model, strategy.lightning_module, strategy.dims
        assert model is not None and module is not None
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in strategy.optimizers]
        strict = module.strict_loading
        with strategy.failures.long_timeout():
            if path.is_file():
                meta, rng = load_full(path, model, optimizers, self._names(), strict, bool(weights_only)), None
            else:
                meta, rng = load_sharded(path, model, optimizers, self._names(), strict=strict)
        saved = meta.get("lightning_nd", {})
        same_layout = saved.get("layout") == dims.as_dict() and saved.get("world_size") == strategy.world_size
        resharded = saved.get("layout", dims.as_dict()) != dims.as_dict()
        strategy.events.emit(CheckpointLoaded(str(path), resharded, time.perf_counter() - start))
        if resharded:
            log.info(f"lightning-nd: resharded `{path}` from {saved['layout']} on {saved['world_size']} ranks to"
                     f" {dims.as_dict()} on {strategy.world_size}")
        if module.trainer.state.fn != TrainerFn.FITTING:
            return meta  # validate/test/predict: the weights are all they take
        if rng is not None and same_layout:
            self._pending_rng = rng  # set as training resumes: starting the data loader draws from it first
        else:
            log.warning(f"lightning-nd: `{path}` has no random state for this layout ({dims.as_dict()} on"
                        f" {strategy.world_size} ranks); dropout and sampling continue from this run's seeds.")
        self._data_position = DataPosition.from_dict(saved["data"]) if "data" in saved else None
        return meta

    def before_training_step(self) -> None:
        """A resumed run's random state is set now: starting the data loader drew from it first."""
        if self._pending_rng is not None:
            _set_rng_states(self._pending_rng)
        self._pending_rng = self._data_position = None  # every training loader has been set up by now

    def resumed_loader(self, dataloader: Any) -> Any:
        trainer = self.strategy.lightning_module.trainer
        if self._data_position is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        return resume_loader(dataloader, self._data_position, self.strategy.dims.batch_size_multiplier, trainer)

    def _layout_info(self, saved_optimizers: int) -> dict[str, Any]:
        """The layout, the data position, and each saved optimizer group's parameter names over all ranks."""
        strategy = self.strategy
        assert strategy.model is not None
        trainer = strategy.lightning_module.trainer
        local = [group_names(strategy.model, o._optimizer if isinstance(o, LightningOptimizer) else o, self._names())
                 for o in strategy.optimizers[:saved_optimizers]]
        names, everywhere, param_names = self._names(), gather(local), []
        for index in range(len(local)):
            groups = [rank_groups[index] for rank_groups in everywhere]
            param_names.append([names.whole_model_order(_merged([g[i] for g in groups])) for i in range(len(groups[0]))])
        dims = strategy.dims
        return {"layout": dims.as_dict(), "world_size": dist.get_world_size(), "param_names": param_names,
                "data": DataPosition.of(trainer, dims.batch_size_multiplier).as_dict()}


def _merged(lists: list[list[str]]) -> list[str]:
    """One list of names from every rank's (replicas repeat names; pipeline ranks hold others), first seen first."""
    seen: dict[str, None] = {}
    for names in lists:
        seen.update(dict.fromkeys(names))
    return list(seen)
