"""Cards into TensorBoard: every monitor's markdown goes through `log_text`, so they sit together in its text tab."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger


def log_text(trainer: Any, tag: str, text: str) -> None:
    """``text`` (markdown) as the card ``tag`` of every TensorBoard logger of ``trainer``, flushed at once: the
    process may be about to end."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(tag, text, global_step=trainer.global_step)
            logger.experiment.flush()
