"""Deterministic synthetic token data: no downloads, the same sample for the same index on every rank.

Sequences follow a fixed rule (``next = (5 * token + 3) % vocab``) 90% of the time, so a model can
learn it and the loss visibly falls within a few dozen steps.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset


class SyntheticTokens(Dataset):
    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, seed: int = 0) -> None:
        self.vocab_size, self.seq_len, self.num_samples, self.seed = vocab_size, seq_len, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        tokens = torch.empty(self.seq_len + 1, dtype=torch.long)
        tokens[0] = torch.randint(self.vocab_size, (1,), generator=generator)
        noise = torch.rand(self.seq_len, generator=generator) < 0.1
        random_tokens = torch.randint(self.vocab_size, (self.seq_len,), generator=generator)
        for t in range(self.seq_len):
            follow = (5 * tokens[t] + 3) % self.vocab_size
            tokens[t + 1] = random_tokens[t] if noise[t] else follow
        return {"tokens": tokens[:-1], "labels": tokens[1:]}


class TokenDataModule(LightningDataModule):
    """Per-rank batches of ``batch_size``; Lightning's sampler splits samples over the batch ranks."""

    def __init__(
        self, vocab_size: int = 256, seq_len: int = 32, num_samples: int = 512, batch_size: int = 4,
        shuffle: bool = True, seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        dataset = SyntheticTokens(hp.vocab_size, hp.seq_len, hp.num_samples, hp.seed)
        return DataLoader(dataset, batch_size=hp.batch_size, shuffle=hp.shuffle)

    def val_dataloader(self) -> DataLoader:
        hp = self.hparams
        dataset = SyntheticTokens(hp.vocab_size, hp.seq_len, max(hp.num_samples // 8, hp.batch_size), hp.seed + 1)
        return DataLoader(dataset, batch_size=hp.batch_size)
