"""Models for the `plan --check` tests (`test_plan_check.py`), each with a fault that shows at a rank's first step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader

from examples.data import SyntheticTokens
from examples.models.llama import Llama, LlamaConfig
from tests.distributed.family_models import LitGPTLM
from tests.distributed.litgpt_models import build_litgpt
from tests.models import VOCAB


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



def litgpt_reading_tokens() -> LightningModule:
    """The LightningModule a LitGPT user writes (tests/distributed/family_models.py): its step reads
    ``batch["tokens"]``, a key the check's own token batches do not have."""
    return LitGPTLM(build_litgpt("llama3"))


class LitGPTWithData(LitGPTLM):
    """The same, with its own dataloader of ``tokens`` and ``labels`` batches: the check runs one of them."""

    def __init__(self) -> None:
        super().__init__(build_litgpt("llama3"))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(SyntheticTokens(VOCAB, 16, 16), batch_size=4)
