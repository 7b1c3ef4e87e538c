"""`CausalLM`: an ordinary LightningModule around any next-token model; nothing in it is parallel.

The model is built in ``configure_model`` (so under `NDParallel` it starts on the meta device and
each rank materialises only its shard), or passed in ready-made (the zero-change path). A model of MoE layers
(`lightning_nd.nn.MoE`) trains with its layers' auxiliary (load-balancing, z) losses added to the step's loss;
under pp the strategy adds them to ``pipeline_loss``'s value itself, the same sum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch import LightningModule
from torch import nn

from lightning_nd.nn.moe import moe_aux_loss


def logits_of(output: object) -> torch.Tensor:
    """Plain tensors, or the ``.logits`` of a Hugging Face output."""
    return output.logits if hasattr(output, "logits") else output


class CausalLM(LightningModule):
    def __init__(
        self,
        model: nn.Module | None = None,
        model_factory: Callable[[], nn.Module] | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        if (model is None) == (model_factory is None):
            raise ValueError("Pass exactly one of `model` (built now) or `model_factory` (built in configure_model).")
        self.model = model
        self.model_factory = model_factory
        self.lr, self.weight_decay = lr, weight_decay
        self.train_samples = torchmetrics.SumMetric()

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.model_factory()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return logits_of(self.model(tokens))

    def pipeline_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """What the model is called with, and what its output is scored against (also used under pp)."""
        return batch["tokens"], batch["labels"]

    def pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss (under pp the last stage calls it on each microbatch)."""
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens, labels = self.pipeline_inputs(batch)
        return self.pipeline_loss(self(tokens), labels)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The next-token loss (logged as ``train_loss``), plus any MoE layers' auxiliary losses (``train_aux_loss``)."""
        loss = self.loss(batch)
        aux = moe_aux_loss(self.model)
        self.train_samples.update(torch.tensor(float(batch["tokens"].shape[0]), device=self.device))
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        if isinstance(aux, torch.Tensor):
            self.log("train_aux_loss", aux, sync_dist=True)
        self.log("train_samples", self.train_samples, on_step=False, on_epoch=True)
        return loss + aux

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
