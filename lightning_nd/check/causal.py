"""`NextToken`: the training step `--check` gives a model that comes without one (a Hugging Face config, a factory
of a plain ``nn.Module``): next-token cross-entropy of ``model(input_ids)`` against ``labels``, AdamW."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn


class NextToken(LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        output: Any = self.model(batch["input_ids"])
        logits = output.logits if hasattr(output, "logits") else output
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def vocabulary(model: nn.Module) -> int:
    """How many token ids the model embeds: its config's ``vocab_size``, else its first embedding's rows."""
    config = getattr(model, "config", None)
    if isinstance(getattr(config, "vocab_size", None), int):
        return int(config.vocab_size)  # type: ignore[union-attr]
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ValueError(f"`{type(model).__name__}` has no `config.vocab_size` and no `nn.Embedding`, so `--check`"
                         " cannot make token ids for it. HINT: return a LightningModule with its own"
                         " `train_dataloader` from the factory.")
    return embedding.num_embeddings
