"""`LayoutCard`: writes the run's parallel layout to TensorBoard once, at the start of fit."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from lightning_nd.layout.describe import layout_markdown
from lightning_nd.strategy.events import LayoutApplied


class LayoutCard(Callback):
    """Text card ``lightning_nd/layout`` (NDParallel runs): what each dim splits, the mesh roles, the TP styles
    and their sources, the pipeline stages, the experts, what was applied, what one rank holds, the warnings
    and every rank's coordinates: the dry run's tables (`python -m lightning_nd.plan`)."""

    def __init__(self) -> None:
        self.applied: LayoutApplied | None = None

    def on_nd_layout_applied(self, strategy: Any, event: LayoutApplied) -> None:
        self.applied = event

    @rank_zero_only
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        event = self.applied
        if event is None:
            return
        card = layout_markdown(event.layout, list(event.applied) if event.applied is not None else None,
                               event.rank_table)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("lightning_nd/layout", card, global_step=0)
