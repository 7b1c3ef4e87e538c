"""Run on each of 4 ranks: MoE models whose routers the test skews, trained through a real `Trainer` with the
`RoutingMonitor` under several layouts; rank 0 then makes the same steps on one process and counts what each router
chose, step by step (tests/distributed/test_routing.py compares them with ``routing.jsonl``).

The skew is the test's, not the models': every token's embedding gets a shared direction and each router's expert
rows a different multiple of it, so the loads are uneven (from 4% to 40% of a layer's assignments) and differ
between layers and steps. SGD (the families' optimizer): what is compared is a function of the model, not of
AdamW's normalisation of near-zero gradients.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from diagnostics import RoutingMonitor, TroubleshootingView
from diagnostics.collect.routers import whole_name
from examples.data import SyntheticTokens, TokenDataModule
from examples.lit import logits_of
from examples.models.llama import Llama, LlamaConfig
from lightning_nd import NDParallel
from lightning_nd.nn.moe import MoE, moe_layers
from tests.distributed.family_models import build_family
from tests.models import VOCAB, build

SEQ_LEN, STEPS, EVERY, LR, BIAS_RATE = 16, 5, 2, 0.05, 0.05
LAYOUTS = {
    # accumulation steps and recomputed (checkpointed) blocks: each forward counted once
    "ep2_fsdp4": ({"dp_shard": 4, "ep": 2, "activation_checkpointing": "full"}, 2, 2),
    "pp2_fsdp2": ({"pp": 2, "dp_shard": 2, "ep": 2, "pp_microbatches": 2}, 4, 1),
    "ep2_tp2": ({"dp_shard": 2, "ep": 2, "tp": 2}, 2, 1),
    "cp2_fsdp2": ({"dp_shard": 2, "cp": 2}, 2, 1),
    "pp2_fsdp2_dense": ({"pp": 2, "dp_shard": 2, "pp_microbatches": 2}, 4, 1),
}
"""name -> (NDParallel options, samples per rank per batch, batches per optimizer step)."""
CASES = [("moe_llama", name) for name in ("ep2_fsdp4", "pp2_fsdp2", "ep2_tp2", "cp2_fsdp2")] + [
    (family, name) for family in ("mixtral", "qwen3_moe") for name in ("ep2_fsdp4", "pp2_fsdp2", "ep2_tp2")] + [
    ("deepseek_v3", "pp2_fsdp2_dense")]  # a dense first layer: the first pipeline stage holds no router
CAPACITY = {("moe_llama", "ep2_tp2"): 1.0}
"""A capacity limit where the ep group holds every token of a forward (so one process drops the same assignments)."""


def routers(model: nn.Module) -> list[nn.Module]:
    """The test's own view of the routers (not the monitor's): the reference and transformers' top-k routers."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


def skewed(model: nn.Module, shift: float = 0.2, strength: float = 0.5) -> nn.Module:
    embed = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    generator = torch.Generator().manual_seed(7)
    direction = torch.randn(embed.weight.shape[1], generator=generator)
    direction /= direction.norm()
    with torch.no_grad():
        embed.weight += direction * embed.weight.norm(dim=1).mean() * shift
        for router in routers(model):
            experts = router.weight.shape[0]
            offsets = torch.linspace(strength, -strength, experts)[torch.randperm(experts, generator=generator)]
            router.weight += offsets[:, None] * direction[None, :]
    return model


def build_model(name: str, capacity: float | None = None) -> nn.Module:
    if name != "moe_llama":
        return skewed(build_family(name))
    model = build("moe_llama_no_aux")
    for layer in moe_layers(model):  # the loss-free bias moves after every step: the routing changes with it
        layer.experts.capacity_factor, layer.bias_update_rate = capacity, BIAS_RATE
    return skewed(model)


def biases(module: nn.Module, stage_attribute: str | None) -> dict[str, list[float]]:
    """Each reference MoE layer's selection bias this rank holds, by its router's whole-model name."""
    return {whole_name(f"{name}.gate", stage_attribute): layer.gate.expert_bias.tolist()
            for name, layer in module.named_modules() if isinstance(layer, MoE)}


class RoutedLM(LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = logits_of(self.model(batch["tokens"]))
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def _fit(model: nn.Module, layout: dict[str, Any], batch: int, accumulate: int, folder: Path, steps: int = STEPS,
         every: int = EVERY, checkpoint: ModelCheckpoint | None = None, resume: str | None = None,
         tensorboard: bool = False) -> tuple[Trainer, RoutingMonitor]:
    monitor = RoutingMonitor(log_dir=str(folder), every_n_steps=every)
    callbacks: list[Any] = [TroubleshootingView(), monitor, *([checkpoint] if checkpoint else [])]
    trainer = Trainer(strategy=NDParallel(**layout), accelerator="cpu", devices=4, max_steps=steps,
                      accumulate_grad_batches=accumulate, callbacks=callbacks,
                      logger=TensorBoardLogger(str(folder), name="", version="") if tensorboard else False,
                      enable_checkpointing=checkpoint is not None, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    dp = trainer.strategy.dims.batch_size_multiplier
    data = TokenDataModule(vocab_size=VOCAB, seq_len=SEQ_LEN, num_samples=batch * dp * accumulate * STEPS,
                           batch_size=batch)
    trainer.fit(RoutedLM(model), datamodule=data, ckpt_path=resume)
    return trainer, monitor


def reference(name: str, dp: int, per_step: int, capacity: float | None = None) -> dict[str, Any]:
    """One process, the same samples per optimizer step (Lightning's sampler: a seed-0 permutation, rank r every
    dp-th, ``per_step`` of them per rank), all in one forward: per step, each router's tokens per expert."""
    module = RoutedLM(build_model(name, capacity))
    optimizer = module.configure_optimizers()
    found = dict((n, m) for n, m in module.named_modules() if m in routers(module))
    counts: dict[str, list[list[int]]] = {n: [] for n in found}
    dropped: dict[str, list[int]] = {n: [] for n in found}
    blocks = {f"{n}.gate": m for n, m in module.named_modules() if m in moe_layers(module)}
    for n, router in found.items():
        router.register_forward_hook(lambda m, a, out, n=n: counts[n].append(
            torch.bincount(out[2].flatten(), minlength=m.weight.shape[0]).tolist()))
    data = SyntheticTokens(VOCAB, SEQ_LEN, per_step * dp * STEPS)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    for step in range(STEPS):
        samples = [i for r in range(dp) for i in order[r::dp][step * per_step:(step + 1) * per_step]]
        optimizer.zero_grad()
        module.loss({key: torch.stack([data[i][key] for i in samples]) for key in ("tokens", "labels")}).backward()
        optimizer.step()
        for layer in moe_layers(module):
            layer.update_bias()
        for n in found:
            dropped[n].append(blocks[n].experts.last_dropped if n in blocks else 0)
    return {"counts": counts, "dropped": dropped, "biases": biases(module, None)}


def verdict_model() -> nn.Module:
    """Three MoE layers (8 experts, top-2) made by the test: layer 0 collapsed (every token to experts 0 and 1),
    layers 1 and 2 routing token t to experts t mod 8 and t + 1 mod 8 (balanced), expert 5 of layer 1 never
    chosen (dead)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, num_experts=8))
    gates = [layer.gate for layer in moe_layers(model)]
    with torch.no_grad():
        basis = torch.linalg.qr(torch.randn(32, 8, generator=torch.Generator().manual_seed(3)))[0].T  # 8 directions
        tokens = torch.arange(VOCAB)
        model.embed_tokens.weight.copy_(basis[tokens % 8] * 4 + basis[(tokens + 1) % 8] * 2)
        gates[0].weight.zero_()
        gates[0].expert_bias.copy_(torch.tensor([9.0, 8.0, 0, 0, 0, 0, 0, 0]))
        for gate in gates[1:]:
            gate.weight.copy_(basis * 8)
        gates[1].expert_bias[5] = -100.0
        for layer in moe_layers(model):
            layer.aux_loss_coef = layer.z_loss_coef = 0.0
    return model


def _lines(folder: Path) -> list[str]:
    path = folder / "diagnostics" / "routing.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def run_all(folder: str) -> dict[str, Any]:
    rank, root = int(os.environ["RANK"]), Path(folder)
    results: dict[str, Any] = {}
    for name, layout_name in CASES:
        layout, batch, accumulate = LAYOUTS[layout_name]
        out = root / f"{name}-{layout_name}"
        trainer, _ = _fit(build_model(name, CAPACITY.get((name, layout_name))), layout, batch, accumulate, out)
        pipeline = trainer.strategy.layout.pipeline
        results[(name, layout_name)] = {"lines": _lines(out), "dp": trainer.strategy.dims.batch_size_multiplier,
                                        "per_step": batch * accumulate, "biases": biases(
                                            trainer.lightning_module, pipeline.attribute if pipeline else None)}
    # A resume: 3 steps with a checkpoint at step 3, then on to 5 from it, in the same log folder.
    layout, batch, accumulate = LAYOUTS["ep2_fsdp4"]
    out = root / "resumed"
    saved = ModelCheckpoint(dirpath=str(out / "checkpoints"), every_n_train_steps=3, save_top_k=-1)
    _fit(build_model("moe_llama"), layout, batch, accumulate, out, steps=3, checkpoint=saved)
    _fit(build_model("moe_llama"), layout, batch, accumulate, out, resume=saved.best_model_path,
         checkpoint=ModelCheckpoint(dirpath=str(out / "checkpoints"), every_n_train_steps=100))
    results["resumed"] = {"lines": _lines(out)}
    # Collapse, a dead expert and a balanced router, with TensorBoard.
    out = root / "verdicts"
    _fit(verdict_model(), {"dp_shard": 4, "ep": 2}, 2, 1, out, steps=4, every=4, tensorboard=True)
    results["verdicts"] = {"lines": _lines(out), "folder": str(out)}
    dist.barrier()
    if rank != 0:
        return {}
    for (name, layout_name) in CASES:
        result = results[(name, layout_name)]
        result["reference"] = reference(name, result["dp"], result["per_step"], CAPACITY.get((name, layout_name)))
    results["resumed"]["reference"] = reference("moe_llama", 4, LAYOUTS["ep2_fsdp4"][1] * LAYOUTS["ep2_fsdp4"][2])
    return results
