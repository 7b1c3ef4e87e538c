"""The whole Trainer on every rank (`test_trainer_trial.py`): a LightningModule that knows nothing of parallelism
(an MLP classifier, SGD with momentum, a per-step LR schedule, torchmetrics objects, ``sync_dist`` and ``on_epoch``
logging, two validation loaders, a ``predict_step`` that post-processes the model's output) run through fit over
3 or more epochs, validation and checkpoints, early stopping, ``validate`` / ``test`` / ``predict`` from the best
checkpoint, a stop and a resume; under `NDParallel` on every rank and as plain Lightning in one process, with no
code of ours in its path. Every run takes the same global batch, so one reference serves every layout.

The runs:
- ``shuffled``: Lightning's own shuffling sampler; accumulation 2, clipping by norm, validation every 2 batches with
  ``limit_val_batches``, the sanity check, ``ModelCheckpoint(monitor=...)`` + ``EarlyStopping`` (it stops in the
  fourth epoch of five).
- ``ordered``: the module's own sampler, in order (``use_distributed_sampler=False``), clipping by value, validation
  every second epoch, 3 epochs.
- ``resumed``: the shuffling sampler, stopped mid-epoch at step 6 and resumed from that file, stopped again at the
  end of the second epoch and resumed with ``ckpt_path="auto"``; its reference runs the 3 epochs uninterrupted.
- ``bf16``: ``ordered`` in ``bf16-mixed``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_nd.pipeline_parallel.stage import PipelineStages
from tests.distributed.parity_ranks import full_copy

FEATURES, HIDDEN, CLASSES = 16, 32, 4
GLOBAL_BATCH = 8
TRAIN_SAMPLES, VAL_SAMPLES, TEST_SAMPLES, PREDICT_SAMPLES = 64, 32, 16, 16
TRAIN_BATCHES, EPOCHS = 4, 3  # ``limit_train_batches``: each epoch a different 32 of the 64, by the sampler's order
RESUME_STOPS = (6, 8)  # mid-way through the second epoch (a file), at its end (found by "auto")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def accuracy() -> MulticlassAccuracy:
    # Synchronised at each step too, so its step value is the global batch's (as in one process).
    return MulticlassAccuracy(num_classes=CLASSES, average="micro", dist_sync_on_step=True)


class Classifier(LightningModule):
    """What a user writes: nothing about layouts."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = MLP()
        self.train_acc, self.test_acc = accuracy(), accuracy()
        self.val_acc = nn.ModuleList([accuracy(), accuracy()])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.float(), y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("seen", float(len(y)), on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y, _ = batch
        logits = self.model(x)
        self.val_acc[dataloader_idx].update(logits, y)
        self.log("val_loss", F.cross_entropy(logits.float(), y), sync_dist=True)
        self.log("val_acc", self.val_acc[dataloader_idx])
        self.log("val_top", logits.float().max(), reduce_fx="max", sync_dist=True)

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y, _ = batch
        logits = self.model(x)
        self.test_acc(logits, y)
        self.log("test_loss", F.cross_entropy(logits.float(), y), sync_dist=True)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        x, _, index = batch
        logits = self.model(x)
        return {"index": index, "ids": logits.argmax(-1), "probs": logits.float().softmax(-1)}

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def dataset(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=generator)
    y = (x[:, :CLASSES] + 0.5 * torch.randn(samples, CLASSES, generator=generator)).argmax(-1)
    return TensorDataset(x, y, torch.arange(samples))


class Data(LightningDataModule):
    """Each rank takes ``GLOBAL_BATCH / batch ranks`` samples a step. ``ordered``: its own in-order sampler from the
    strategy's ``distributed_sampler_kwargs`` (one process: all of it), for a run without Lightning's sampler."""

    def __init__(self, ordered: bool = False) -> None:
        super().__init__()
        self.ordered = ordered

    def _sharding(self) -> dict[str, int]:
        return getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}

    def _loader(self, data: TensorDataset, sampler: Any = None) -> DataLoader:
        return DataLoader(data, batch_size=GLOBAL_BATCH // self._sharding()["num_replicas"], sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        data = dataset(TRAIN_SAMPLES, 1)
        if self.ordered:
            return self._loader(data, DistributedSampler(data, shuffle=False, **self._sharding()))
        if self.trainer.world_size == 1:  # one process: the permutation Lightning's sampler makes on many
            return self._loader(data, DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0))
        return self._loader(data)

    def val_dataloader(self) -> list[DataLoader]:
        return [self._loader(dataset(VAL_SAMPLES, 2)), self._loader(dataset(VAL_SAMPLES, 3))]

    def test_dataloader(self) -> DataLoader:
        return self._loader(dataset(TEST_SAMPLES, 4))

    def predict_dataloader(self) -> DataLoader:
        return self._loader(dataset(PREDICT_SAMPLES, 5))


class Record(Callback):
    """Every number the Trainer shows: per batch (loss, accuracy, lr), per validation, per epoch; the start."""

    def __init__(self) -> None:
        self.batches: list[dict[str, float]] = []
        self.validations: list[dict[str, float]] = []
        self.epochs: list[dict[str, float]] = []
        self.start: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: Trainer, module: LightningModule) -> None:
        if not self.start:
            self.start = parameters(module)

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, *args: Any) -> None:
        metrics = trainer.callback_metrics
        self.batches.append({"step": trainer.global_step, "loss": float(metrics["train_loss_step"]),
                             "acc": float(metrics["train_acc_step"]),
                             "lr": trainer.optimizers[0].param_groups[0]["lr"]})

    def on_validation_end(self, trainer: Trainer, module: LightningModule) -> None:
        self.validations.append({"sanity": float(trainer.sanity_checking), "step": trainer.global_step,
                                 **numbers(trainer.callback_metrics, "val_")})

    def on_train_epoch_end(self, trainer: Trainer, module: LightningModule) -> None:
        self.epochs.append(numbers(trainer.callback_metrics, "train_loss_epoch", "train_acc_epoch", "seen"))

    def numbers(self) -> dict[str, Any]:
        return {"batches": self.batches, "validations": self.validations, "epochs": self.epochs, "start": self.start}


def numbers(metrics: dict[str, Any], *prefixes: str) -> dict[str, float]:
    return {name: float(value) for name, value in metrics.items() if name.startswith(prefixes)}


def parameters(module: LightningModule) -> dict[str, torch.Tensor]:
    """Whole parameters under the model's own names (a collective under FSDP: every rank calls it)."""
    return {PipelineStages.original_name(name.removeprefix("model.")): full_copy(param)
            for name, param in module.named_parameters()}


def trainer(strategy: Any, devices: int, root: Path, callbacks: list[Callback], **options: Any) -> Trainer:
    return Trainer(strategy=strategy, accelerator="cpu", devices=devices, default_root_dir=root, callbacks=callbacks,
                   logger=False, enable_progress_bar=False, enable_model_summary=False, deterministic=False,
                   **options)


def step_of(path: str) -> int:
    found = re.search(r"step=(\d+)", path)
    assert found, path
    return int(found.group(1))


def evaluate(fit: Trainer, module: LightningModule, data: Data) -> dict[str, Any]:
    """``validate`` / ``test`` / ``predict`` from the best checkpoint (its numbers by sample index for predict)."""
    predictions = fit.predict(module, datamodule=data, ckpt_path="best")
    by_index = {}
    for batch in predictions:
        for i, index in enumerate(batch["index"].tolist()):
            by_index[index] = {"id": int(batch["ids"][i]), "probs": batch["probs"][i].clone()}
    return {"validate": fit.validate(module, datamodule=data, ckpt_path="best", verbose=False),
            "test": fit.test(module, datamodule=data, ckpt_path="best", verbose=False),
            "predict": by_index}


def shuffled(strategy: Any, devices: int, root: Path) -> dict[str, Any]:
    record, module = Record(), Classifier()
    best = ModelCheckpoint(dirpath=root / "ckpt", monitor="val_loss/dataloader_idx_0", save_top_k=2,
                           filename="{epoch}-{step}")
    stop = EarlyStopping(monitor="val_loss/dataloader_idx_0", patience=2)
    fit = trainer(strategy, devices, root, [record, best, stop], max_epochs=EPOCHS + 2,
                  limit_train_batches=TRAIN_BATCHES, accumulate_grad_batches=2, gradient_clip_val=1.0,
                  val_check_interval=2, limit_val_batches=3)
    data = Data()
    fit.fit(module, datamodule=data)
    result = {"record": record.numbers(), "end": parameters(module), "best_step": step_of(best.best_model_path),
              "best_score": float(best.best_model_score), "stopped_epoch": stop.stopped_epoch,
              "global_step": fit.global_step}
    return {**result, **evaluate(fit, module, data)}


def ordered(strategy: Any, devices: int, root: Path, precision: str = "32-true") -> dict[str, Any]:
    record, module = Record(), Classifier()
    fit = trainer(strategy, devices, root, [record], max_epochs=EPOCHS, limit_train_batches=TRAIN_BATCHES,
                  precision=precision, gradient_clip_val=0.05, gradient_clip_algorithm="value", check_val_every_n_epoch=2,
                  use_distributed_sampler=False, enable_checkpointing=False)
    fit.fit(module, datamodule=Data(ordered=True))
    return {"record": record.numbers(), "end": parameters(module), "global_step": fit.global_step}


def resumed(strategy_factory: Any, devices: int, root: Path) -> dict[str, Any]:
    """Three fits of one module class: to step 6 (a file every 3 steps), from that file to the end of epoch 1 (a
    file at each epoch's end), then ``ckpt_path="auto"`` to the end."""
    record, folder = Record(), root / "resume"
    plans = [({"max_steps": RESUME_STOPS[0]}, None,
              ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=-1, filename="{step}")),
             ({"max_epochs": 2}, str(folder / f"step={RESUME_STOPS[0]}.ckpt"),
              ModelCheckpoint(dirpath=folder, save_top_k=-1, filename="end-{epoch}-{step}",
                              save_on_train_epoch_end=True)),
             ({"max_epochs": EPOCHS}, "auto", ModelCheckpoint(dirpath=folder, save_top_k=0))]
    module = None
    for limits, ckpt_path, checkpoint in plans:
        module = Classifier()
        fit = trainer(strategy_factory(), devices, root, [record, checkpoint], limit_train_batches=TRAIN_BATCHES,
                      limit_val_batches=0, num_sanity_val_steps=0, **limits)
        fit.fit(module, datamodule=Data(), ckpt_path=ckpt_path)
    assert module is not None
    return {"record": record.numbers(), "end": parameters(module), "global_step": fit.global_step}


def reference(root: str) -> dict[str, Any]:
    """Plain Lightning in one process (no code of ours); ``resumed`` runs uninterrupted."""
    base = Path(root)
    record, module = Record(), Classifier()
    fit = trainer("auto", 1, base / "uninterrupted", [record], max_epochs=EPOCHS, limit_train_batches=TRAIN_BATCHES,
                  limit_val_batches=0, num_sanity_val_steps=0, enable_checkpointing=False)
    fit.fit(module, datamodule=Data())
    return {"shuffled": shuffled("auto", 1, base / "shuffled"), "ordered": ordered("auto", 1, base / "ordered"),
            "resumed": {"record": record.numbers(), "end": parameters(module), "global_step": fit.global_step},
            "bf16": ordered("auto", 1, base / "bf16", precision="bf16-mixed")}


def layouts(root: str, layouts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every layout in turn on these ranks (one process group, a fresh Trainer each)."""
    from lightning_nd import NDParallel

    world, results = int(os.environ["WORLD_SIZE"]), {}
    for name, layout in layouts.items():
        base = Path(root) / name
        results[name] = {"shuffled": shuffled(NDParallel(**layout), world, base / "shuffled"),
                         "ordered": ordered(NDParallel(**layout), world, base / "ordered"),
                         "resumed": resumed(lambda layout=layout: NDParallel(**layout), world, base / "resumed"),
                         "bf16": ordered(NDParallel(**layout), world, base / "bf16", precision="bf16-mixed")}
    return results
