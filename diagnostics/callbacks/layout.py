"""`LayoutCard`: writes the run's parallel layout to TensorBoard once, at the start of fit."""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from lightning_nd.layout.describe import layout_markdown


class LayoutCard(Callback):
    """Text card ``lightning_nd/layout`` (NDParallel runs): what each dim splits, the mesh roles, the TP styles
    and their sources, the pipeline stages, the experts, what was applied, what one rank holds, the warnings
    and every rank's coordinates: the dry run's tables (`python -m lightning_nd.plan`)."""

    @rank_zero_only
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        layout = getattr(trainer.strategy, "layout_or_none", None)
        if layout is None:
            return
        report = trainer.strategy.report
        card = layout_markdown(layout, report.lines() if report is not None else None, trainer.strategy.dims.rank_table())
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("lightning_nd/layout", card, global_step=0)
