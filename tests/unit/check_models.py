"""Models for the `plan --check` tests (`test_plan_check.py`), each with a fault that shows at a rank's first step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule

from examples.models.llama import Llama, LlamaConfig


def max_norm_embedding() -> Llama:
    """A Llama whose token embedding renormalises its rows on lookup (``nn.Embedding(max_norm=...)``): the in-place
    ``embedding_renorm_`` kernel has no rule for a tensor-parallel (sharded) embedding."""
    model = Llama(LlamaConfig())
    model.embed_tokens.max_norm = 1.0
    return model


class TwiceInAStep(LightningModule):
    """A step that calls the model twice (a second forward for a consistency loss): one call per step under pp."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Llama(LlamaConfig())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        first, second = self.model(batch["input_ids"]), self.model(batch["input_ids"])
        loss = F.cross_entropy(first.flatten(0, 1), batch["labels"].flatten())
        return loss + (first - second).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def experts() -> Llama:
    """A Llama of MoE layers: its step reads how many tokens each expert got, a value a fake tensor does not have."""
    return Llama(LlamaConfig(num_experts=4))


class NoBatches(TwiceInAStep):
    """Its own dataloader has no batch (a filter that dropped every sample): fit ends without a step."""

    def train_dataloader(self) -> list:
        return []
