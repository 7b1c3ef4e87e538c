"""Family parity, run on every rank: each `transformers` family under each layout through a real `Trainer`,
then, on rank 0, the same steps on one process (tests/distributed/test_families.py). A family/layout the plan
refuses is recorded with its message (checked by the test against the refusals it expects), not trained.

The optimizer is SGD with momentum: AdamW divides each update by the gradient's own size, so an element
whose gradient is float noise moves by the full learning rate, and after 3 steps the last gradients of a
few embedding elements differ from one process by 2e-4 relative (measured on Mistral; at the first step
they agree to 4e-8). SGD keeps what is compared a function of the model, not of that noise."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer

from examples.data import SyntheticTokens, TokenDataModule
from lightning_nd import NDParallel
from lightning_nd.pipeline_parallel.stage import PipelineStages
from lightning_nd.planner.dry_run import plan_for, read_layout_arguments
from tests.distributed.family_models import BUILT_LATER, family_module
from tests.distributed.parity_ranks import full_copy
from tests.models import VOCAB

SEQ_LEN, STEPS, LR = 16, 3, 0.05


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


class Start(Callback):
    """The whole tensors this rank holds when training starts (a model built in `configure_model`, materialised):
    the one-process reference starts from them."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.params = {PipelineStages.original_name(name): full_copy(p)  # a collective per DTensor
                       for name, p in pl_module.model.named_parameters()}


def _train(family: str, layout: dict[str, Any], world: int, batch: int) -> dict[str, Any]:
    try:
        plan_for(read_layout_arguments(layout), world, family_module(family))
    except ValueError as refusal:
        return {"refused": str(refusal)}
    losses, start = Losses(), Start()
    trainer = Trainer(strategy=NDParallel(**layout), accelerator="cpu", devices=world, max_steps=STEPS,
                      callbacks=[losses, start], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    dp = trainer.strategy.dims.batch_size_multiplier
    module = family_module(family, lr=LR)
    trainer.fit(module, datamodule=TokenDataModule(vocab_size=VOCAB, seq_len=SEQ_LEN, num_samples=batch * dp * STEPS,
                                                   batch_size=batch))
    named = [(PipelineStages.original_name(name), p) for name, p in module.model.named_parameters()]
    later = {"start": start.params} if family.startswith(BUILT_LATER) else {}
    return {"losses": losses.losses, "dp": dp, "params": {n: full_copy(p) for n, p in named},
            "grads": {n: full_copy(p.grad) for n, p in named}, **later}


def reference(family: str, dp: int, batch: int, chunk: int, start: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """One process, the same samples per step (Lightning's sampler: a seed-0 permutation, rank r every dp-th),
    forwarded ``chunk`` samples at a time as the parallel ranks do, the loss their mean. ``start``: the whole
    parameters a model built in `configure_model` started from, loaded into plain construction."""
    module = family_module(family.removeprefix(BUILT_LATER), lr=LR)
    if start is not None:
        with torch.no_grad():
            for name, param in module.model.named_parameters(remove_duplicate=False):
                param.copy_(start[name])
    optimizer = module.configure_optimizers()
    data = SyntheticTokens(VOCAB, SEQ_LEN, batch * dp * STEPS)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    losses = []
    for step in range(STEPS):
        samples = [order[r::dp][step * batch:(step + 1) * batch] for r in range(dp)]
        chunks = [rank[i:i + chunk] for rank in samples for i in range(0, batch, chunk)]
        optimizer.zero_grad()
        loss = torch.stack([module.loss({key: torch.stack([data[i][key] for i in part]) for key in ("tokens", "labels")})
                            for part in chunks]).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    aliases = {name: name for name, _ in module.model.named_parameters()}
    owner = {id(p): name for name, p in module.model.named_parameters()}
    aliases |= {name: owner[id(p)] for name, p in module.model.named_parameters(remove_duplicate=False)}
    return {"losses": losses, "aliases": aliases,
            "params": {n: p.detach().clone() for n, p in module.model.named_parameters()},
            "grads": {n: p.grad.clone() for n, p in module.model.named_parameters()}}


def run(cases: list[tuple[str, str]], layouts: dict[str, dict[str, Any]], batch: dict[str, int],
        chunk: dict[str, int], options: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every rank trains each (family, layout) case; ``options``: a family's own `NDParallel` options for layouts
    with tp; rank 0 adds the references."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    results = {}
    for family, name in cases:
        layout = {**layouts[name], **(options.get(family, {}) if layouts[name].get("tp", 1) > 1 else {})}
        results[(family, name)] = {"parallel": _train(family, layout, world, batch[name])}
    dist.barrier()
    starts = {case: _whole_start(result["parallel"].pop("start"), world) for case, result in results.items()
              if "start" in result["parallel"]}
    if rank == 0:
        for (family, name), result in results.items():
            if "refused" not in result["parallel"]:
                result["reference"] = reference(family, result["parallel"]["dp"], batch[name], chunk[name],
                                                starts.get((family, name)))
    return results


def _whole_start(held: dict[str, torch.Tensor], world: int) -> dict[str, torch.Tensor] | None:
    """On rank 0, every rank's start together (under pp each rank holds its stages' tensors only)."""
    gathered: list[dict[str, torch.Tensor] | None] = [None] * world
    dist.gather_object(held, gathered if dist.get_rank() == 0 else None, dst=0)
    return {name: value for part in gathered if part is not None for name, value in part.items()} or None
