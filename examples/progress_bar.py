"""The example's progress bar: Lightning's own, without an epoch total where the run has none.

Lightning picks `RichProgressBar` when rich is installed. A run bounded by ``max_steps`` alone has
``max_epochs=-1``, and Lightning 2.6's bar then says ``Epoch 0/-2`` (Lightning-AI/pytorch-lightning#21925, fixed
upstream by #21924, not in 2.6.6); this one says ``Epoch 0``, as the fix does. Its count beside it already runs to
``max_steps``.
"""

from __future__ import annotations

import importlib.util

from lightning.pytorch.callbacks import Callback, RichProgressBar
from typing_extensions import override


class StepBoundProgressBar(RichProgressBar):
    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs != -1:
            return super()._get_train_description(current_epoch)
        # Padded to the validation bar's description as Lightning pads it, so neither flickers.
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"


def progress_bars(enabled: bool) -> list[Callback]:
    """The bar for the Trainer's callbacks; none where Lightning's choice has no epoch total (tqdm, without rich)
    or the Trainer shows no bar."""
    return [StepBoundProgressBar()] if enabled and importlib.util.find_spec("rich") else []
