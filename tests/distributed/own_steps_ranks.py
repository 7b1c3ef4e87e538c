"""A plain LightningModule under pp, run on every rank (tests/distributed/test_own_steps.py): no pipeline hooks,
its own ``training_step`` / ``validation_step`` compute the loss and log; one with a model taking ``labels``
(a Hugging Face model computes its own shifted loss), one adding MoE auxiliary losses. Compared with the same
steps on one process, accumulated over the pipeline's microbatches."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric

from examples.data import SyntheticTokens
from lightning_nd import NDParallel
from lightning_nd.nn.moe import moe_aux_loss
from lightning_nd.pipeline_parallel.stage import PipelineStages
from tests.distributed.parity_ranks import full_copy
from tests.models import VOCAB, build

SEQ_LEN, BATCH, STEPS, LR = 16, 4, 3, 1e-3
MICROBATCHES = BATCH  # 2 x pp, the default


class OwnStepLM(LightningModule):
    """Nothing about pipelines: the loss from the model's output (or the model's own, given ``labels``) and logs."""

    def __init__(self, model: torch.nn.Module, mode: str) -> None:
        super().__init__()
        self.model, self.mode = model, mode

    def cross_entropy(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.mode == "labels":  # the model shifts `labels` itself
            return self.model(input_ids=batch["tokens"], labels=batch["tokens"]).loss
        logits = self.model(batch["tokens"])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss, its cross-entropy part): with ``mode="aux"`` every MoE layer's auxiliary losses are added."""
        ce = self.cross_entropy(batch)
        return (ce + moe_aux_loss(self.model), ce) if self.mode in ("aux", "hooks_aux") else (ce, ce)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        loss, ce = self.loss(batch)
        # Under pp the stages add the auxiliary losses themselves (`moe_aux_loss` is 0.0 in the step): log ce.
        self.log("my_train_loss", ce, sync_dist=True)
        self.log("tokens_seen", float(batch["tokens"].numel()), reduce_fx="sum")
        self.log_dict({"first_token": batch["tokens"][:, 0].float().max()}, reduce_fx="max")
        return {"loss": loss}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.cross_entropy(batch)
        self.log("my_val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)


class HookedLM(OwnStepLM):
    """The example's way (`examples/lit.py`): ``pipeline_inputs`` and ``pipeline_loss``, which the strategy scores
    under pp instead of running the step; in one process the step adds the MoE auxiliary losses, under pp the
    strategy does (both layers of ``moe_llama``, one per stage)."""

    def pipeline_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return batch["tokens"], batch["labels"]

    def pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, ce = self.loss(batch)
        self.log("train_loss", ce, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.cross_entropy(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss


def _module(model_name: str, mode: str) -> OwnStepLM:
    return (HookedLM if mode == "hooks_aux" else OwnStepLM)(build(model_name), mode)


class Logged(Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _data(seed: int, count: int, order: list[int] | None = None) -> DataLoader:
    return DataLoader(SyntheticTokens(VOCAB, SEQ_LEN, count, seed=seed), batch_size=BATCH, sampler=order)



def _parallel(model_name: str, mode: str, layout: dict[str, Any], world: int) -> dict[str, Any]:
    logged = Logged()
    trainer = Trainer(strategy=NDParallel(**layout), accelerator="cpu", devices=world, max_steps=STEPS,
                      callbacks=[logged], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    module = _module(model_name, mode)
    trainer.fit(module, train_dataloaders=_data(0, BATCH * STEPS))
    named = [(PipelineStages.original_name(name), p) for name, p in module.model.named_parameters()]
    result = {"logged": logged.steps, "params": {name: full_copy(p) for name, p in named},
              "grads": {name: full_copy(p.grad) for name, p in named}}
    trainer.limit_val_batches = 1.0  # validation zeroes the gradients: they are taken before it
    val = trainer.validate(module, dataloaders=_data(1, 2 * BATCH), verbose=False)[0]
    return {**result, "val": {k: float(v) for k, v in val.items()}}


def _reference(model_name: str, mode: str) -> dict[str, Any]:
    module = _module(model_name, mode)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01)
    steps = []
    # Lightning's DistributedSampler (seed 0) permutes the training samples; one batch rank takes them all.
    order = torch.randperm(BATCH * STEPS, generator=torch.Generator().manual_seed(0)).tolist()
    for batch in _data(0, BATCH * STEPS, order):
        optimizer.zero_grad()
        # The pipeline's microbatches (one sample each), accumulated: a rarely seen embedding row's gradient
        # differs from the whole batch's by float noise alone, which 3 AdamW steps amplify past the tolerances.
        losses, ces = zip(*[module.loss({"tokens": batch["tokens"][i:i + 1], "labels": batch["labels"][i:i + 1]})
                            for i in range(MICROBATCHES)])
        torch.stack(losses).mean().backward()
        optimizer.step()
        steps.append({"train_loss": torch.stack(ces).mean().item()} if mode == "hooks_aux" else {
            "my_train_loss": torch.stack(ces).mean().item(), "tokens_seen": float(batch["tokens"].numel()),
            "first_token": batch["tokens"][:, 0].float().max().item()})
    with torch.no_grad():
        losses = [module.cross_entropy(batch) * len(batch["tokens"]) for batch in _data(1, 2 * BATCH)]
    val = "val_loss" if mode == "hooks_aux" else "my_val_loss"
    return {"logged": steps, "val": {val: (sum(losses) / (2 * BATCH)).item()},
            "params": {n: p.detach().clone() for n, p in module.model.named_parameters()},
            "grads": {n: p.grad.clone() for n, p in module.model.named_parameters()}}


class Refused(OwnStepLM):
    """A step only the last stage can find wrong: its error must reach every rank of the pipeline, not leave the
    first stage waiting."""

    def __init__(self, fault: str) -> None:
        super().__init__(build("llama"), "logits")
        self.fault, self.mean_loss = fault, MeanMetric()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        loss = self.cross_entropy(batch)
        if self.fault == "mean_of_losses":
            self.mean_loss(loss)  # one number per microbatch: no batch value
        return None if self.fault == "returns_none" else loss

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(batch["tokens"]) + self.model(batch["tokens"])  # twice: refused


def _refused(fault: str, world: int) -> str:
    trainer = Trainer(strategy=NDParallel(pp=2, dp_shard=1, timeout=60), accelerator="cpu", devices=world,
                      max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    try:
        if fault == "predict_twice":
            trainer.predict(Refused(fault), dataloaders=_data(1, BATCH))
        else:
            trainer.fit(Refused(fault), train_dataloaders=_data(0, BATCH))
    except ValueError as error:
        return str(error)
    return "not refused"


def run(cases: dict[str, tuple[str, str, dict[str, Any]]], faults: list[str]) -> dict[str, Any]:
    """Every rank trains each case and meets each fault; rank 0 adds the one-process reference."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    results: dict[str, Any] = {key: {"parallel": _parallel(name, mode, layout, world)}
                               for key, (name, mode, layout) in cases.items()}
    results["refused"] = {fault: _refused(fault, world) for fault in faults}
    dist.barrier()
    if rank == 0:
        for key, (name, mode, _) in cases.items():
            results[key]["reference"] = _reference(name, mode)
    return results
