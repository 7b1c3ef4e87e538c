"""The model a user builds in `configure_model` (on the meta device, materialised rank by rank), as each layout starts
it, against plain construction (the same factory called on the CPU, no code of ours in its path).

Runs inside the parity launches (`parity.run_layouts(starts=...)`): each start builds its model in `configure_model`,
trains one step and returns, per rank, the whole tensors' facts when training starts (size, standard deviation, kind
of init), which names share one tensor, the copies a pipeline keeps of a tie spanning stages, and the first step's
loss. `assert_starts_like_plain` compares them with plain construction over `SEEDS` seeds:

- the same tensors and ties (under pp a tie spanning stages is a copy on the first and the last stage, equal), so the
  same parameter count, copies counted once;
- no two tensors drawn alike (a rank's stage drawing what another stage drew);
- every tensor of at least `LARGE` elements within `STD_TOLERANCE` of plain construction's standard deviation, the
  smaller ones the same kind of init (zero, constant, random);
- the first-step loss within max(5%, 3 standard deviations over the seeds) of plain construction's mean.

Each rank seeds its process with `START_SEED` + its rank before the start: the strategy must agree on one seed (rank
0's) for replicas to match, and the start is the same on every run, so a start in the tail of plain construction's
losses fails every time instead of once in a while (with 20 seeds, about 1% of the seeds land beyond 3 standard
deviations of a normal loss; unseeded, the examples' MoE once started at 2.8 standard deviations below the mean).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch import Callback, Trainer
from torch import nn
from torch.utils.data import DataLoader

from examples.data import SyntheticTokens, TokenDataModule
from examples.lit import CausalLM, logits_of
from examples.models.gpt import GPT, GPTConfig
from examples.models.llama import Llama, LlamaConfig
from lightning_nd import NDParallel
from lightning_nd.nn.moe import moe_aux_loss
from lightning_nd.pipeline_parallel.stage import PipelineStages
from tests.distributed.parity_ranks import SEQ_LEN, LossRecorder, full_copy
from tests.models import VOCAB, build

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"
SEEDS = 20
START_SEED = 1000
LARGE = 1000
STD_TOLERANCE = 0.10


def conf_model(name: str) -> dict[str, Any]:
    """A model config of `conf/model/<name>.yaml`, as the examples' Hydra config gives it."""
    values = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    return {key: value for key, value in values.items() if key not in ("defaults", "name")}


class OwnInitGPT(GPT):
    """A GPT that initialises itself in its constructor, as GPT-2 and nanoGPT do (normal(0, 0.02), zero biases), its
    head tied to the embedding and, in every block, the second norm's parameters tied to the first's (a tie inside
    one pipeline stage)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        for block in self.blocks:
            block.ln_2.weight, block.ln_2.bias = block.ln_1.weight, block.ln_1.bias
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)


def meta_model(name: str) -> nn.Module:
    """The models built in `configure_model`: the examples' as `conf/model/` configures them, a module that
    initialises itself, the Hugging Face Llama of the parity suite (its `post_init` initialises it) and LitGPT's
    (``litgpt:<key>``), each drawn from the random state as it is (seeded by the run, or by `plain_starts`)."""
    if name == "gpt":
        return GPT(GPTConfig(**conf_model("gpt")))
    if name in ("llama", "moe"):
        return Llama(LlamaConfig(**conf_model(name)))
    if name == "own_init":
        return OwnInitGPT(GPTConfig(**conf_model("gpt")))
    return build(name, torch.initial_seed())


class StartFacts(Callback):
    """When training starts, on each rank: the facts of every whole tensor it holds (whole-model names), the names
    that share one tensor, and the whole values of the tied weights a pipeline keeps a copy of."""

    def on_train_start(self, trainer, pl_module) -> None:
        tensors: dict[int, list[str]] = {}
        first: dict[int, torch.Tensor] = {}
        for name, param in pl_module.model.named_parameters(remove_duplicate=False):
            tensors.setdefault(id(param), []).append(PipelineStages.original_name(name))
            first.setdefault(id(param), param)
        params = {tensors[key][0]: full_copy(param) for key, param in first.items()}  # a collective per DTensor
        self.params = {name: describe(value) for name, value in params.items()}
        self.ties = sorted(sorted(names) for names in tensors.values() if len(names) > 1)
        pipeline = trainer.strategy.layout.pipeline
        tied = {name for pair in pipeline.split.tied for name in pair} if pipeline is not None else set()
        self.copies = {name: value for name, value in params.items() if name in tied}


def describe(tensor: torch.Tensor) -> tuple[int, float, str, tuple[float, ...]]:
    """(elements, standard deviation, kind of init: zero, constant or random, its first values)."""
    flat = tensor.detach().double().flatten()
    kind = "zero" if not flat.any() else "constant" if bool((flat == flat[0]).all()) else "random"
    return flat.numel(), float(flat.std()) if flat.numel() > 1 else 0.0, kind, tuple(flat[:4].tolist())


def start(model_name: str, layout: dict[str, Any], world: int, rank: int, batch: int) -> dict[str, Any]:
    """Build ``model_name`` in `configure_model` under ``layout``, train one step; what each rank started from."""
    torch.manual_seed(START_SEED + rank)
    facts, recorder = StartFacts(), LossRecorder()
    trainer = Trainer(strategy=NDParallel(**layout), accelerator="cpu", devices=world, max_steps=1, precision="32-true",
                      callbacks=[facts, recorder], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    dp = trainer.strategy.dims.batch_size_multiplier
    data = TokenDataModule(vocab_size=VOCAB, seq_len=SEQ_LEN, num_samples=batch * dp, batch_size=batch)
    trainer.fit(CausalLM(model_factory=lambda: meta_model(model_name)), datamodule=data)
    return {"params": facts.params, "ties": facts.ties, "copies": facts.copies, "loss": recorder.losses[0],
            "global_batch": batch * dp}


def plain_starts(model_name: str, global_batch: int) -> list[dict[str, Any]]:
    """Plain construction with seeds 0 to `SEEDS` - 1: its tensors' facts, its ties and the loss (with its MoE
    layers' auxiliary losses, as the step adds them) on the first global batch."""
    tokens = next(iter(DataLoader(SyntheticTokens(VOCAB, SEQ_LEN, global_batch), batch_size=global_batch)))
    starts = []
    for seed in range(SEEDS):
        torch.manual_seed(seed)
        model = meta_model(model_name)
        tensors: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            tensors.setdefault(id(param), []).append(name)
        with torch.no_grad():
            logits = logits_of(model(tokens["tokens"]))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens["labels"].flatten()) + moe_aux_loss(model)
        starts.append({"params": {name: describe(p) for name, p in model.named_parameters()},
                       "ties": sorted(sorted(names) for names in tensors.values() if len(names) > 1),
                       "count": sum(p.numel() for p in model.parameters()), "loss": float(loss)})
    return starts


def assert_starts_like_plain(per_rank: list[dict], key: str, model_name: str) -> None:
    """The layout ``key`` started from the model plain construction gives (see the module's docstring)."""
    results = [rank_result[key]["start"] for rank_result in per_rank]
    plain = plain_starts(model_name, results[0]["global_batch"])
    params: dict[str, tuple] = {}
    for result in results:
        for name, facts in result["params"].items():
            assert params.setdefault(name, facts) == facts, f"{name}: replicas started differently"
    ties = {tuple(group) for result in results for group in result["ties"]}
    copies = {name: value for result in results for name, value in result["copies"].items()}
    expected_ties = {tuple(group) for group in plain[0]["ties"]}
    assert ties <= expected_ties, f"ties plain construction does not make: {ties - expected_ties}"
    copied = 0
    for group in expected_ties - ties:  # only a tie a pipeline splits between its first and last stage
        assert set(group) <= copies.keys(), f"the tie {group} is lost: neither one tensor nor the pipeline's copies"
        for name in group[1:]:
            torch.testing.assert_close(copies[name], copies[group[0]], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
            copied += params[name][0]
    count = sum(facts[0] for facts in params.values()) - copied
    assert count == plain[0]["count"], f"{count} parameters, plain construction has {plain[0]['count']}"
    drawn = [facts[3] for name, facts in params.items() if facts[2] == "random" and name not in copies]
    assert len(set(drawn)) == len(drawn), "two tensors started with the same random values"
    for name, (numel, std, kind, _) in plain[0]["params"].items():
        got_numel, got_std, got_kind, _ = params[name]
        assert got_numel == numel, name
        if numel >= LARGE:
            expected = statistics.mean(start["params"][name][1] for start in plain)
            assert math.isclose(got_std, expected, rel_tol=STD_TOLERANCE, abs_tol=1e-12), (name, got_std, expected)
        else:
            assert got_kind == kind, (name, got_kind, kind)
    losses = [start["loss"] for start in plain]
    mean, spread = statistics.mean(losses), statistics.stdev(losses)
    bound = max(0.05 * mean, 3 * spread)
    loss = results[0]["loss"]
    assert abs(loss - mean) <= bound, f"first-step loss {loss:.4g}, plain construction's {mean:.4g} ± {bound:.3g}"
