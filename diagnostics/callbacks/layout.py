"""`LayoutCard`: writes the run's parallel layout to TensorBoard once, at the start of fit."""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from diagnostics.analysis.layout import layout_markdown


class LayoutCard(Callback):
    """Text card ``lightning_nd/layout``: dims, applied techniques and rank coordinates (NDParallel runs)."""

    @rank_zero_only
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = trainer.strategy
        dims = getattr(strategy, "dims", None)
        if dims is None:
            return
        applied = strategy.report.lines() if getattr(strategy, "report", None) else []
        card = layout_markdown({k: v for k, v in dims.as_dict().items() if k != "world_size"}, applied,
                               dims.rank_table())
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("lightning_nd/layout", card, global_step=0)
