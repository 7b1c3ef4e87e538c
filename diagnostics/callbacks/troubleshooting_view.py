"""`TroubleshootingView`: the one owner of the run's TensorBoard custom-scalars layout.

TensorBoard shows one custom-scalars layout per run (a second one written replaces the first), so no monitor
writes its own: each registers its charts here while it sets up, and the view writes the layout once, on rank 0,
when training starts. A margin chart shows the mean across ranks with the min and max as its band: the monitors
log ``<tag>/mean``, ``<tag>/min`` and ``<tag>/max`` (`diagnostics.report.tensorboard.spread`).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger

CATEGORY = "Troubleshooting: "


class TroubleshootingView(Callback):
    def __init__(self) -> None:
        self.charts: dict[str, dict[str, list[Any]]] = {}
        """Category -> chart title -> ``["Margin", [mean, min, max]]`` or ``["Multiline", tags]``."""
        self.written = False

    @staticmethod
    def of(trainer: Trainer) -> TroubleshootingView | None:
        """The Trainer's view, if it has one."""
        return next((c for c in trainer.callbacks if isinstance(c, TroubleshootingView)), None)

    def margin(self, category: str, title: str, tag: str) -> None:
        """A chart of ``tag``'s mean across ranks, banded by its min and max."""
        self.charts.setdefault(CATEGORY + category, {})[title] = ["Margin", [f"{tag}/mean", f"{tag}/min", f"{tag}/max"]]

    def multiline(self, category: str, title: str, tags: list[str]) -> None:
        """One chart with a line per tag (a regex matches several: ``memory/.*/rank\\d+``)."""
        self.charts.setdefault(CATEGORY + category, {})[title] = ["Multiline", list(tags)]

    def layout(self) -> dict[str, dict[str, list[Any]]]:
        return {category: dict(charts) for category, charts in sorted(self.charts.items())}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_rank != 0 or self.written or not self.charts:
            return
        self.written = True
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_custom_scalars(self.layout())
                logger.experiment.flush()
