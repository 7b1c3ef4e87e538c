"""Into TensorBoard: every monitor's markdown goes through `log_text`, so the cards sit together in its text tab;
values across ranks become `spread` scalars, which the `TroubleshootingView`'s margin charts show."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger


def log_text(trainer: Any, tag: str, text: str) -> None:
    """``text`` (markdown) as the card ``tag`` of every TensorBoard logger of ``trainer``, flushed at once: the
    process may be about to end."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(tag, text, global_step=trainer.global_step)
            logger.experiment.flush()


def log_figure(trainer: Any, tag: str, figure: Any) -> None:
    """A matplotlib ``Figure`` as the image ``tag`` of every TensorBoard logger (``add_figure``)."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_figure(tag, figure, global_step=trainer.global_step, close=False)
            logger.experiment.flush()


def log_count_histogram(trainer: Any, tag: str, counts: Sequence[int]) -> None:
    """``counts[i]`` items at value ``i`` (tokens per expert) as the histogram ``tag`` of every TensorBoard logger: one
    bucket per value, from ``i - 0.5`` to ``i + 0.5``."""
    total = sum(counts)
    if not total:
        return
    used = [i for i, count in enumerate(counts) if count]
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_histogram_raw(
                tag, min=used[0], max=used[-1], num=total, sum=sum(i * c for i, c in enumerate(counts)),
                sum_squares=sum(i * i * c for i, c in enumerate(counts)),
                bucket_limits=[i + 0.5 for i in range(len(counts))], bucket_counts=list(counts),
                global_step=trainer.global_step)


def spread(tag: str, values: Sequence[float]) -> dict[str, float]:
    """``<tag>/mean``, ``/min`` and ``/max`` of one value per rank."""
    return {f"{tag}/mean": sum(values) / len(values), f"{tag}/min": min(values), f"{tag}/max": max(values)}
