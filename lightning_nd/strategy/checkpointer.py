"""Mixin for `NDParallel`: Lightning's checkpoint hooks, on `lightning_nd.checkpoint`.

Lightning asks the strategy for the model's and optimizers' state, then hands the whole checkpoint to
``save_checkpoint``; ``load_checkpoint`` loads model and optimizers in place and returns the rest
(loops, schedulers) for Lightning to restore. Both run under the long (start-up) timeout.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger("lightning_nd")


class ShardedCheckpoints:
    """Save: a folder of shards per rank under whole-model names (any layout can load it). Load: that
    folder, or one file of whole tensors (an export, or any Lightning checkpoint)."""

    _data_position: DataPosition | None = None
    _pending_rng: dict[str, Any] | None = None
    last_checkpoint: Path | None = None

    def _names(self) -> Names:
        plan = self.report.stage_plan if self.report is not None else None
        if plan is None:
            return Names()
        return Names(plan.attribute, [unit for stage in plan.layout.stages for unit in stage])

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return model_state(self.model, self._names())

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return optimizer_state(self.model, optimizer, self._names())

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("`NDParallel.save_checkpoint(..., storage_options=...)` is not supported: it writes with"
                            " torch.distributed.checkpoint, not a `CheckpointIO` plugin.")
        path = Path(self.broadcast(str(filepath)))
        state = {"model": checkpoint.pop("state_dict")}
        optimizer_states = checkpoint.pop("optimizer_states", [])  # none when saving weights only
        state.update({f"optimizer_{i}": s for i, s in enumerate(optimizer_states)})
        checkpoint["lightning_nd"] = info = self._layout_info(len(optimizer_states))
        with self._long_timeout():
            save_sharded(path, state, checkpoint, _collect_rng_states(), info | {"global_step": checkpoint.get("global_step")})
        self.last_checkpoint = path

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.model is not None and self.lightning_module is not None
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        strict = self.lightning_module.strict_loading
        with self._long_timeout():
            if path.is_file():
                meta, rng = load_full(path, self.model, optimizers, self._names(), strict, bool(weights_only)), None
            else:
                meta, rng = load_sharded(path, self.model, optimizers, self._names(), strict=strict)
        saved = meta.get("lightning_nd", {})
        same_layout = saved.get("layout") == self.dims.as_dict() and saved.get("world_size") == self.world_size
        if saved.get("layout", self.dims.as_dict()) != self.dims.as_dict():
            log.info(f"lightning-nd: resharded `{path}` from {saved['layout']} on {saved['world_size']} ranks to"
                     f" {self.dims.as_dict()} on {self.world_size}")
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            return meta  # validate/test/predict: the weights are all they take
        if rng is not None and same_layout:
            self._pending_rng = rng  # set as training resumes: starting the data loader draws from it first
        else:
            log.warning(f"lightning-nd: `{path}` has no random state for this layout ({self.dims.as_dict()} on"
                        f" {self.world_size} ranks); dropout and sampling continue from this run's seeds.")
        self._data_position = DataPosition.from_dict(saved["data"]) if "data" in saved else None
        return meta

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pending_rng is not None:
            _set_rng_states(self._pending_rng)
        self._pending_rng = self._data_position = None  # every training loader has been set up by now
        return super().training_step(*args, **kwargs)

    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer
        if self._data_position is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        return resume_loader(dataloader, self._data_position, self.dims.batch_size_multiplier, trainer)

    def _layout_info(self, saved_optimizers: int) -> dict[str, Any]:
        """The layout, the data position, and each saved optimizer group's parameter names over all ranks."""
        assert self.model is not None
        trainer = self.lightning_module.trainer
        local = [group_names(self.model, o._optimizer if isinstance(o, LightningOptimizer) else o, self._names())
                 for o in self.optimizers[:saved_optimizers]]
        names, everywhere, param_names = self._names(), gather(local), []
        for index in range(len(local)):
            groups = [rank_groups[index] for rank_groups in everywhere]
            param_names.append([names.whole_model_order(_merged([g[i] for g in groups])) for i in range(len(groups[0]))])
        return {"layout": self.dims.as_dict(), "world_size": dist.get_world_size(), "param_names": param_names,
                "data": DataPosition.of(trainer, self.dims.batch_size_multiplier).as_dict()}


def _merged(lists: list[list[str]]) -> list[str]:
    """One list of names from every rank's (replicas repeat names; pipeline ranks hold others), first seen first."""
    seen: dict[str, None] = {}
    for names in lists:
        seen.update(dict.fromkeys(names))
    return list(seen)
