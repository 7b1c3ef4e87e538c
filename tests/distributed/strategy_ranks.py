"""Scenarios run on every rank of a 4-rank launch; each returns facts that the tests assert on.

They cover what the strategy promises beyond numerical parity: meta-device construction, which
ranks share samples and metrics, mixed precision, the ZeRO stages' sync behaviour, a user's own
`configure_model`, and errors that can only show up once a batch arrives.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from examples.data import TokenDataModule
from examples.lit import CausalLM
from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import Llama, LlamaConfig
from lightning_nd import NDParallel
from tests.distributed.parity_ranks import LossRecorder, reference
from tests.models import VOCAB, build

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))  # read at import: Lightning's teardown unsets it


def _trainer(layout: dict[str, Any], **kwargs: Any) -> Trainer:
    options = dict(accelerator="cpu", devices=WORLD_SIZE, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   limit_val_batches=0, num_sanity_val_steps=0)
    return Trainer(strategy=NDParallel(**layout), **{**options, **kwargs})


class MetaBuilt(CausalLM):
    """Builds its model in `configure_model` and records whether that happened on the meta device."""

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.model_factory()
            self.built_on_meta = all(p.is_meta for p in self.model.parameters())


META_MODELS = {
    "gpt": lambda: GPT(GPTConfig(vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=2)),
    "llama": lambda: Llama(LlamaConfig(vocab_size=VOCAB, num_hidden_layers=2)),
}


class InitialWeights(Callback):
    """The full fc1 weight of block 0 as materialised, before any step."""

    def on_train_start(self, trainer, pl_module) -> None:
        first = pl_module.model.blocks[0].fc1 if hasattr(pl_module.model, "blocks") else pl_module.model.layers[0].mlp.up_proj
        self.weight = first.weight.full_tensor().detach()


def meta_init(layout: dict[str, Any], model_name: str) -> dict[str, Any]:
    """Build on meta, shard, materialise: who holds what, are shards distinct and replicas equal."""
    recorder, initial = LossRecorder(), InitialWeights()
    trainer = _trainer(layout, max_steps=30, callbacks=[recorder, initial])
    module = MetaBuilt(model_factory=META_MODELS[model_name], lr=1e-2)
    trainer.fit(module, datamodule=TokenDataModule(vocab_size=VOCAB, seq_len=32, num_samples=512, batch_size=8))
    total = sum(p.numel() for p in module.model.parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.model.parameters())
    full = initial.weight
    tp_group = trainer.strategy.device_mesh.group("tp")
    not_split_by_tp = [
        name for name, p in module.model.named_parameters()
        if "tp" not in (p.device_mesh.mesh_dim_names or ()) or p.placements[-1].is_replicate()
    ]
    differing = [name for name in not_split_by_tp if not _same_on_group(module.model.get_parameter(name), tp_group)]
    return {
        "built_on_meta": module.built_on_meta,
        "any_meta_left": any(p.is_meta for p in module.model.parameters()),
        "local_fraction": local / total,
        "distinct_rows": torch.unique(full, dim=0).shape[0], "rows": full.shape[0],
        "weight_std": full.std().item(), "weight_expected_std": (1 / (3 * full.shape[1])) ** 0.5,
        "tp_replicated": not_split_by_tp,
        "tp_replicas_differing": differing,
        "losses": recorder.losses,
    }


def _same_on_group(param: DTensor, group) -> bool:
    """Every rank of ``group`` holds identical local values of ``param``."""
    local = param.to_local().detach().contiguous()
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return all(torch.equal(gathered[0], other) for other in gathered)


class SampleIds(Callback):
    """The first token of every sample each rank trains on (a sample id: the data's seed is per index)."""

    def __init__(self) -> None:
        self.firsts: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.firsts.append(batch["tokens"][:, :4].flatten().tolist())


class CountingLM(CausalLM):
    """Logs a 1 from every rank, summed with `sync_dist`: the count of ranks the log reduces over."""

    def training_step(self, batch, batch_idx):
        self.log("ranks_in_sync", 1.0, sync_dist=True, reduce_fx="sum", on_step=True, on_epoch=False)
        return super().training_step(batch, batch_idx)


def batch_ranks(layout: dict[str, Any]) -> dict[str, Any]:
    """Which samples each rank sees, the synced sample count, and cross-rank decisions."""
    ids = SampleIds()
    trainer = _trainer(layout, max_epochs=1, callbacks=[ids])
    module = CountingLM(model=build("llama"))
    data = TokenDataModule(vocab_size=VOCAB, seq_len=16, num_samples=20, batch_size=2)
    trainer.fit(module, datamodule=data)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ids.firsts)
    rank = dist.get_rank()
    decide = trainer.strategy.reduce_boolean_decision
    return {
        "samples_per_rank": gathered,
        "train_samples": trainer.callback_metrics["train_samples"].item(),
        "ranks_in_sync": trainer.callback_metrics["ranks_in_sync"].item(),
        # ModelCheckpoint and EarlyStopping agree across ranks through these (all=True sums over the world).
        "decisions": [decide(True), decide(rank == 0, all=True), decide(rank == 0, all=False)],
        "dataset": [data.train_dataloader().dataset[i]["tokens"][:4].tolist() for i in range(20)],
    }


class SyncProbe(Callback):
    """Whether FSDP reduced gradients after each micro-batch, and whether block 0 stayed gathered after forward."""

    def __init__(self) -> None:
        self.reduce_grads: list[bool] = []
        self.gathered_after_forward: list[bool] = []
        self.hooked = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.hooked:
            block = pl_module.model.layers[0]
            block.register_forward_hook(lambda *_: self.gathered_after_forward.append(_group(block).is_unsharded))
            self.hooked = True

    def on_after_backward(self, trainer, pl_module) -> None:
        self.reduce_grads.append(_group(pl_module.model.layers[0]).reduce_grads)


def _group(module: FSDPModule):
    return module._get_fsdp_state()._fsdp_param_group


def zero_sync(zero_stage: int) -> dict[str, Any]:
    probe = SyncProbe()
    trainer = _trainer({"dp_shard": 4, "zero_stage": zero_stage}, max_steps=2, accumulate_grad_batches=2,
                       callbacks=[probe])
    trainer.fit(CausalLM(model=build("llama")),
                datamodule=TokenDataModule(vocab_size=VOCAB, seq_len=16, num_samples=64, batch_size=2))
    return {"reduce_grads": probe.reduce_grads, "gathered_after_forward": probe.gathered_after_forward}


def precision(precision_flag: str) -> dict[str, Any]:
    """bf16 runs: parameter dtypes, FSDP's gather dtype, and the loss per step."""
    recorder = LossRecorder()
    trainer = _trainer({"dp_shard": 2, "tp": 2}, max_steps=6, precision=precision_flag, callbacks=[recorder])
    module = CausalLM(model=build("llama"), lr=3e-3)
    trainer.fit(module, datamodule=TokenDataModule(vocab_size=VOCAB, seq_len=16, num_samples=96, batch_size=4))
    block = module.model.layers[0]
    mp_policy = block._get_fsdp_state()._mp_policy
    return {
        "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        "fsdp_param_dtype": str(mp_policy.param_dtype),
        "losses": recorder.losses,
    }


class OwnParallelism(CausalLM):
    """A user's custom parallel code in `configure_model`: the strategy must leave it alone."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["fsdp"]
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def own_configure_model() -> dict[str, Any]:
    recorder = LossRecorder()
    trainer = _trainer({"dp_shard": 4}, max_steps=5, callbacks=[recorder])
    module = OwnParallelism(model=build("llama"), lr=1e-3)
    trainer.fit(module, datamodule=TokenDataModule(vocab_size=VOCAB, seq_len=16, num_samples=40, batch_size=2))
    params = {n: p.full_tensor().detach() for n, p in module.model.named_parameters()}
    return {"composer_ran": trainer.strategy.report is not None, "losses": recorder.losses, "params": params,
            "reference": reference("llama", 8, None) if dist.get_rank() == 0 else None}


def indivisible_sequence() -> str:
    trainer = _trainer({"dp_shard": 2, "tp": 2, "sequence_parallel": True}, max_steps=1)
    try:
        trainer.fit(CausalLM(model=build("llama")),
                    datamodule=TokenDataModule(vocab_size=VOCAB, seq_len=15, num_samples=16, batch_size=2))
    except ValueError as error:
        return str(error)
    return "no error"


class GradLayouts(Callback):
    """Parameters whose gradient does not have the parameter's own placements when the optimizer runs."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.mismatched = [
            name for name, p in pl_module.named_parameters()
            if isinstance(p, DTensor) and p.grad is not None and p.grad.placements != p.placements
        ]


def grad_layouts(layout: dict[str, Any]) -> list[str]:
    probe = GradLayouts()
    trainer = _trainer(layout, max_steps=1, callbacks=[probe])
    trainer.fit(CausalLM(model=build("llama")),
                datamodule=TokenDataModule(vocab_size=VOCAB, seq_len=16, num_samples=16, batch_size=2))
    return probe.mismatched


SCENARIOS = {
    "grad_layouts_tp4_sp": lambda: grad_layouts({"tp": 4, "sequence_parallel": True}),
    "meta_init_gpt": lambda: meta_init({"dp_shard": 2, "tp": 2}, "gpt"),
    "meta_init_llama": lambda: meta_init({"dp_shard": 2, "tp": 2, "sequence_parallel": True}, "llama"),
    "batch_ranks": lambda: batch_ranks({"dp_shard": 2, "tp": 2}),
    "zero1": lambda: zero_sync(1),
    "zero2": lambda: zero_sync(2),
    "zero3": lambda: zero_sync(3),
    "bf16_mixed": lambda: precision("bf16-mixed"),
    "bf16_true": lambda: precision("bf16-true"),
    "own_configure_model": own_configure_model,
    "indivisible_sequence": indivisible_sequence,
}


def run_all() -> dict[str, Any]:
    """Every scenario in one process group; a scenario that raises reports its error instead of a result."""
    results: dict[str, Any] = {}
    for name, scenario in SCENARIOS.items():
        try:
            results[name] = {"result": scenario()}
        except Exception as error:  # reported per scenario by the tests
            results[name] = {"error": f"{type(error).__name__}: {error}"}
    return results
