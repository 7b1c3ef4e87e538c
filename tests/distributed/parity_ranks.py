"""Parity scenario run on every rank: train a model with `NDParallel` through a real `Trainer`, then
compare loss per step, final gradients and final parameters with a plain one-process loop on rank 0.

Several layouts share one launch (one process group, a fresh Trainer and mesh per layout) because
starting 4 Python processes costs more than training a tiny model for 5 steps.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from examples.data import SyntheticTokens, TokenDataModule
from examples.lit import CausalLM, logits_of
from lightning_nd import Layout, NDParallel
from lightning_nd.pipeline_parallel.stage import PipelineStages
from tests.models import VOCAB, build

SEQ_LEN = 16
PER_RANK_BATCH = 2
STEPS = 5
ACCUMULATE = 2
LR = 1e-3
VAL_BATCHES = 2


class LossRecorder(Callback):
    """The loss of each step, averaged over the batch ranks by the strategy (as `self.log(sync_dist=True)` is)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Lightning hands back the loss divided by the accumulation factor (what backward saw).
        loss = outputs["loss"].detach() * trainer.accumulate_grad_batches
        self.losses.append(trainer.strategy.reduce(loss, reduce_op="mean").item())


class ShardBytes(Callback):
    """After setup, before any step: every parameter's local bytes (``to_local()``) and FSDP's padded storage
    on this rank, under whole-model names, beside what the strategy's Layout planned for this rank."""

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.fsdp import FSDPModule

        padded = {}
        for module in pl_module.modules():
            group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
            for fsdp_param in group.fsdp_params if group is not None else ():
                data = fsdp_param._sharded_param_data
                padded[id(fsdp_param.sharded_param)] = data.numel() * data.element_size()
        layout = trainer.strategy.layout
        plan = layout.pipeline
        self.measured = {}
        for name, param in pl_module.named_parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            whole = name if plan is None else f"{plan.attribute}.{PipelineStages.original_name(name[len(plan.attribute) + 1:])}"
            size = local.numel() * local.element_size()
            self.measured[whole] = (size, padded.get(id(param), size))
        mine = layout.rank(trainer.global_rank)
        self.planned = {shard.name: (shard.bytes, shard.padded_bytes) for shard in mine.params}
        self.roundtrip = Layout.from_json(layout.to_json()) == layout

    def on_train_end(self, trainer, pl_module) -> None:
        """The model state after the last step (its gradients still there), local shards, against the cost model."""
        from lightning_nd.cost.model_state import model_state

        local = lambda t: t.to_local() if hasattr(t, "to_local") else t
        size = lambda tensors: sum(local(t).numel() * t.element_size() for t in tensors if t is not None)
        optimizer = trainer.optimizers[0]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.state_measured = {"params": size(params), "grads": size(p.grad for p in params),
                               "optimizer": size(v for s in optimizer.state.values() for v in s.values()
                                                 if torch.is_tensor(v))}
        expected = model_state(trainer.strategy.layout, trainer.global_rank)
        self.state_planned = {"params": expected.params_bytes, "grads": expected.grads_bytes,
                              "optimizer": expected.optimizer_bytes}


def assert_layout_matches_shards(per_rank: list, layout: str) -> None:
    """On every rank, the Layout's bytes per parameter equal the shard measured after parallelize (exactly,
    unpadded and padded), the Layout survived a JSON round trip, and the cost model's parameter, gradient and
    optimizer bytes (`lightning_nd.cost.model_state`) equal the local shards after the last step."""
    for rank, result in enumerate(per_rank):
        holdings = result[layout]["parallel"]["holdings"]
        assert holdings["roundtrip"], f"rank {rank}: the Layout changed through JSON"
        assert holdings["planned"] == holdings["measured"], f"rank {rank}: planned != measured"
        assert holdings["measured"], f"rank {rank}: no parameters measured"
        assert holdings["state_planned"] == holdings["state_measured"], f"rank {rank}: model state {holdings}"
        assert holdings["state_measured"]["grads"] > 0, f"rank {rank}: no gradients measured"


def techniques(parallel: dict) -> dict[str, dict]:
    """The composer's records of one run, by technique."""
    return {record["technique"]: record for record in parallel["applied"]}


def full_copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def _train_parallel(model_name: str, layout: dict[str, Any], clip: float | None, accumulate: int, world: int,
                    batch: int, validate: bool) -> dict[str, Any]:
    model = build(model_name)
    recorder, shard_bytes = LossRecorder(), ShardBytes()
    # Under pp Lightning's sanity check validates before the first step (and never again in these 5 steps): an
    # evaluation once left FSDP's units gathered and cost the next step its gradients.
    sanity = int(layout.get("pp", 1) > 1)
    trainer = Trainer(
        strategy=NDParallel(**layout), accelerator="cpu", devices=world, max_steps=STEPS, precision="32-true",
        gradient_clip_val=clip, accumulate_grad_batches=accumulate, callbacks=[recorder, shard_bytes], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=sanity, num_sanity_val_steps=sanity, check_val_every_n_epoch=STEPS,
    )
    dp = trainer.strategy.dims.batch_size_multiplier
    data = TokenDataModule(vocab_size=VOCAB, seq_len=SEQ_LEN, num_samples=batch * dp * accumulate * STEPS,
                           batch_size=batch)
    module = CausalLM(model=model, lr=LR)
    trainer.fit(module, datamodule=data)
    named = [(PipelineStages.original_name(name), p) for name, p in module.model.named_parameters()]
    result = {"losses": recorder.losses, "params": {name: full_copy(p) for name, p in named},
              "grads": {name: full_copy(p.grad) for name, p in named}, "global_batch": batch * dp * accumulate,
              "applied": [asdict(t) for t in trainer.strategy.report.applied] if trainer.strategy.report else [],
              "timings": trainer.strategy.pipeline_timings,
              "holdings": {"measured": shard_bytes.measured, "planned": shard_bytes.planned,
                           "roundtrip": shard_bytes.roundtrip, "state_measured": shard_bytes.state_measured,
                           "state_planned": shard_bytes.state_planned}}
    if validate:
        val = DataLoader(SyntheticTokens(VOCAB, SEQ_LEN, VAL_BATCHES * batch * dp * accumulate, seed=1), batch_size=batch)
        trainer.limit_val_batches = 1.0  # the fit validated one batch at most (the sanity check, under pp)
        result["val_loss"] = trainer.validate(module, dataloaders=val, verbose=False)[0]["val_loss"]
        if layout.get("pp", 1) > 1:  # predict: the last stage's logits, handed to every rank
            result["predictions"] = torch.cat(trainer.predict(module, dataloaders=val))
            result["dp"], result["dp_rank"] = dp, trainer.strategy.device_mesh.local_rank("batch")
    return result


def reference(model_name: str, global_batch: int, clip: float | None) -> dict[str, Any]:
    """The same training on one process with plain torch: the ground truth.

    ``global_batch`` counts every sample of one optimizer step; with gradient accumulation the
    mean loss over the accumulated micro-batches is the mean over this one larger batch.
    """
    model = build(model_name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    dataset = SyntheticTokens(VOCAB, SEQ_LEN, global_batch * STEPS)
    # Lightning's DistributedSampler (seed 0, epoch 0) permutes, then rank r takes every dp-th index:
    # the union over ranks of step i is the i-th contiguous chunk of that permutation.
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
    losses, unclipped_norms = [], []
    for batch in DataLoader(dataset, batch_size=global_batch, sampler=order):
        optimizer.zero_grad()
        logits = logits_of(model(batch["tokens"]))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        loss.backward()
        if clip:
            unclipped_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        val = SyntheticTokens(VOCAB, SEQ_LEN, VAL_BATCHES * global_batch, seed=1)
        val_batch = next(iter(DataLoader(val, batch_size=len(val))))
        val_logits = logits_of(model(val_batch["tokens"]))
        val_loss = F.cross_entropy(val_logits.flatten(0, 1).float(), val_batch["labels"].flatten()).item()
    return {
        "losses": losses,
        "val_loss": val_loss,
        "val_logits": val_logits,
        "max_unclipped_norm": max(unclipped_norms, default=0.0),
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "grads": {name: p.grad.clone() for name, p in model.named_parameters()},
        "tied": _tied_names(model),
    }


def _tied_names(model: torch.nn.Module) -> dict[str, str]:
    """A shared weight's other names -> the name `named_parameters` gives it (a tied head -> the embedding)."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
    return {name: first[id(param)] for name, param in model.named_parameters(remove_duplicate=False)
            if first[id(param)] != name}


def run_layouts(
    model_name: str,
    layouts: dict[str, dict[str, Any]],
    clip: dict[str, float] | None = None,
    accumulate: dict[str, int] | None = None,
    batch: dict[str, int] | None = None,
    validate: list[str] | None = None,
    starts: dict[str, tuple[str, dict[str, Any]]] | None = None,
) -> Any:
    """Every rank trains each layout and returns what it holds; rank 0 also runs the reference.

    ``batch``: per-rank batch size by layout (default 2; pipelines need one microbatch or more per
    stage); ``validate``: layouts whose validation loss after training is compared too; ``starts``: by name, a
    model built in `configure_model` and a layout, whose start each rank returns (`meta_starts.start`).
    """
    from tests.distributed.meta_starts_ranks import start

    clip, accumulate, batch, validate = clip or {}, accumulate or {}, batch or {}, validate or []
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])  # Lightning's teardown unsets them
    results = {}
    for key, layout in layouts.items():
        parallel = _train_parallel(model_name, layout, clip.get(key), accumulate.get(key, 1), world,
                                   batch.get(key, PER_RANK_BATCH), key in validate)
        results[key] = {"parallel": parallel}
    for key, (start_model, layout) in (starts or {}).items():
        results[key] = {"start": start(start_model, layout, world, rank, batch.get(key, PER_RANK_BATCH))}
    dist.barrier()
    if rank != 0:
        return results  # its own copies of every parameter: replicas must agree with rank 0's reference
    references: dict[tuple[int, float | None], dict[str, Any]] = {}
    for key, result in results.items():
        if "parallel" not in result:
            continue
        ref_key = (result["parallel"]["global_batch"], clip.get(key))
        if ref_key not in references:
            references[ref_key] = reference(model_name, *ref_key)
        result["reference"] = references[ref_key]
    return results


def launcher(tmp_path_factory, launches: dict[str, tuple], starts: dict[str, dict] | None = None, **options: Any):
    """A function running one named launch (world size, model, layouts, per-rank batch) once, on first use;
    ``starts``: by launch, the `configure_model` starts it also runs (`run_layouts`); ``options`` go to
    `run_layouts` (clip, accumulate)."""
    from tests.launcher import launch

    done: dict[str, list] = {}

    def run(name: str) -> list:
        if name not in done:
            world, model, layouts, batch = launches[name]
            extra = (starts or {}).get(name, {})
            done[name] = launch("tests.distributed.parity_ranks:run_layouts", world, tmp_path_factory.mktemp(name),
                                timeout=900, model_name=model, layouts=layouts,
                                batch=dict.fromkeys([*layouts, *extra], batch), validate=list(layouts), starts=extra,
                                **options)
        return done[name]

    return run


def merged(per_rank: list, layout: str, what: str) -> dict[str, torch.Tensor]:
    """Every rank's ``params`` or ``grads`` by name; ranks holding the same one must agree bit for bit."""
    result: dict[str, torch.Tensor] = {}
    for rank_result in per_rank:
        for name, value in rank_result[layout]["parallel"][what].items():
            if name in result:
                torch.testing.assert_close(value, result[name], rtol=0, atol=0, msg=lambda m: f"replicas of {name}: {m}")
            result[name] = value
    return result


def assert_state_matches(per_rank: list, layout: str) -> None:
    """Gradients and parameters, merged over ranks, equal the one-process reference's (every one present).
    Under pp a weight tied between the first and the last stage is there twice: the last stage's copy under
    its own name (the head's) equals the one weight, and equals the first stage's copy bit for bit."""
    reference = per_rank[0][layout]["reference"]
    params, grads = merged(per_rank, layout, "params"), merged(per_rank, layout, "grads")
    copies = reference["tied"] if "pipeline_split" in techniques(per_rank[0][layout]["parallel"]) else {}
    assert params.keys() == reference["params"].keys() | copies.keys()
    for copy, weight in copies.items():
        for what, values in (("param", params), ("grad", grads)):
            torch.testing.assert_close(values[copy], values[weight], rtol=0, atol=0,
                                       msg=lambda m: f"{what} {copy}: {m}")
    for name, expected in reference["grads"].items():
        torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=2e-6, msg=lambda m: f"grad {name}: {m}")
    for name, expected in reference["params"].items():
        torch.testing.assert_close(params[name], expected, rtol=1e-4, atol=5e-5, msg=lambda m: f"param {name}: {m}")


def assert_training_matches(per_rank: list, layout: str, applied: str, clip: float | None = None) -> None:
    """A layout trained like one process: the technique ``applied`` was applied (to some parameters); each
    rank holds what its Layout says; loss per optimizer step (micro-steps averaged), gradients and
    parameters match; every rank's validation loss matches; with ``clip``, clipping really acted (the
    one-process gradient norm exceeded it)."""
    parallel, reference = per_rank[0][layout]["parallel"], per_rank[0][layout]["reference"]
    assert applied in techniques(parallel), parallel["applied"]
    assert_layout_matches_shards(per_rank, layout)
    steps = torch.tensor(parallel["losses"]).view(STEPS, -1).mean(dim=1)
    torch.testing.assert_close(steps, torch.tensor(reference["losses"]), rtol=1e-6, atol=2e-6)
    assert_state_matches(per_rank, layout)
    for result in per_rank:
        val_loss = result[layout]["parallel"]["val_loss"]
        assert abs(val_loss - reference["val_loss"]) <= 2e-6 + 1e-6 * abs(reference["val_loss"]), val_loss
    if clip is not None:
        assert reference["max_unclipped_norm"] > clip
