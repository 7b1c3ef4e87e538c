"""The cost model's expected peak per rank next to the peak torch's `MemTracker` measures, on 4 CPU processes.

    python benchmarks/memory_model.py            # every layout below (about 5 minutes)
    python benchmarks/memory_model.py --only tp  # the layouts whose name contains "tp"

Each layout trains `examples.lit.CausalLM` through `Trainer(strategy=NDParallel(...))` for two steps; the
second runs inside `MemTracker` (which counts every tensor torch allocates, by kind: parameters, gradients,
optimizer state, activations, temporaries). Measured = the highest peak of the 4 ranks; expected =
`lightning_nd.cost.memory.peak_rank` on the run's own `Layout`, model shape and batch. Nothing in the cost
model is fitted to these numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import PeakMemory  # noqa: E402
from benchmarks.launch import run_on_ranks  # noqa: E402

WORLD_SIZE = 4
DENSE = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4)
DEEP = dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2)
MOE = dict(DENSE, num_experts=8, num_experts_per_tok=2, intermediate_size=256)
MODELS = {"dense": (DENSE, 4, 256), "deep": (DEEP, 4, 512), "moe": (MOE, 4, 128)}
"""name: (LlamaConfig, batch per rank, sequence length)."""
LAYOUTS = [
    ("dense", "dp_shard=4 zero3", {"dp_shard": 4}),
    ("dense", "dp_shard=4 zero2", {"dp_shard": 4, "zero_stage": 2}),
    ("dense", "dp_shard=4 zero1", {"dp_shard": 4, "zero_stage": 1}),
    ("dense", "dp_shard=4 full AC", {"dp_shard": 4, "activation_checkpointing": "full"}),
    ("dense", "dp_shard=4 selective AC", {"dp_shard": 4, "activation_checkpointing": "selective"}),
    ("dense", "dp_replicate=2 x dp_shard=2", {"dp_replicate": 2, "dp_shard": 2}),
    ("dense", "dp_replicate=4", {"dp_replicate": 4, "dp_shard": 1}),
    ("dense", "tp=4", {"tp": 4}),
    ("dense", "tp=4 sp", {"tp": 4, "sequence_parallel": True}),
    ("dense", "dp_shard=2 x tp=2", {"dp_shard": 2, "tp": 2}),
    ("dense", "dp_shard=2 x tp=2 sp selective AC", {"dp_shard": 2, "tp": 2, "sequence_parallel": True,
                                                    "activation_checkpointing": "selective"}),
    ("dense", "pp=2 x dp_shard=2 1f1b", {"pp": 2, "dp_shard": 2}),
    ("dense", "pp=2 x dp_shard=2 gpipe", {"pp": 2, "dp_shard": 2, "pp_schedule": "gpipe"}),
    ("dense", "pp=4 1f1b", {"pp": 4, "dp_shard": 1, "pp_microbatches": 4}),
    ("dense", "pp=2 x tp=2", {"pp": 2, "tp": 2, "dp_shard": 1}),
    ("dense", "cp=2 x dp_shard=2", {"cp": 2, "dp_shard": 2}),
    ("dense", "cp=4", {"cp": 4, "dp_shard": 1}),
    ("dense", "cp=2 x tp=2", {"cp": 2, "tp": 2, "dp_shard": 1}),
    ("deep", "dp_shard=4 zero3", {"dp_shard": 4}),
    ("deep", "dp_shard=4 full AC", {"dp_shard": 4, "activation_checkpointing": "full"}),
    ("deep", "tp=2 x dp_shard=2 sp", {"tp": 2, "dp_shard": 2, "sequence_parallel": True}),
    ("deep", "pp=2 x dp_shard=2 interleaved", {"pp": 2, "dp_shard": 2, "pp_schedule": "interleaved_1f1b"}),
    ("deep", "pp=4 gpipe", {"pp": 4, "dp_shard": 1, "pp_schedule": "gpipe", "pp_microbatches": 4}),
    ("moe", "ep=2 x dp_shard=4", {"ep": 2, "dp_shard": 4}),
    ("moe", "ep=4 x dp_shard=4", {"ep": 4, "dp_shard": 4}),
    ("moe", "ep=2 x dp_shard=2 x tp=2", {"ep": 2, "dp_shard": 2, "tp": 2}),
]


def measure(model: str, layout: dict) -> tuple[int, int, dict]:
    from examples.data import TokenDataModule
    from examples.lit import CausalLM
    from examples.models.llama import Llama, LlamaConfig
    from lightning_nd import NDParallel
    from lightning_nd.cost.memory import peak_rank
    from lightning_nd.cost.shape import Workload, model_shape

    config, batch, seq_len = MODELS[model]
    probe = PeakMemory(step=1)
    trainer = Trainer(strategy=NDParallel(**layout), accelerator="cpu", devices=WORLD_SIZE, max_steps=2,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, callbacks=[probe])
    torch.manual_seed(0)
    lit = CausalLM(model=Llama(LlamaConfig(**config)))
    with torch.device("meta"):
        shape = model_shape(Llama(LlamaConfig(**config)))
    data = TokenDataModule(vocab_size=config["vocab_size"], seq_len=seq_len, num_samples=batch * 4 * 2, batch_size=batch)
    trainer.fit(lit, datamodule=data)
    measured = torch.tensor([probe.peak_bytes])
    everyone = [torch.zeros_like(measured) for _ in range(WORLD_SIZE)]
    dist.all_gather(everyone, measured)
    expected = peak_rank(trainer.strategy.layout, shape, Workload(seq_len=seq_len, batch=batch))
    return max(int(t) for t in everyone), expected.peak_bytes, {"probe": probe.by_kind, "expected": expected}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated parts of layout names")
    parser.add_argument("--detail", action="store_true")
    args = parser.parse_args()
    rank_zero = int(os.environ.get("RANK", 0)) == 0
    if rank_zero:
        print(f"\n{'model':6} {'layout':36} {'measured peak':>14} {'expected':>14} {'ratio':>6}", flush=True)
    rows = []
    for model, name, layout in LAYOUTS:
        if args.only and not any(part in f"{model} {name}" for part in args.only.split(",")):
            continue
        measured, expected, detail = measure(model, layout)
        rows.append((measured, expected))
        if rank_zero:
            print(f"{model:6} {name:36} {measured:>14,} {expected:>14,} {expected / measured:>6.3f}", flush=True)
            if args.detail:
                print("   measured:", detail["probe"], "\n   expected:", detail["expected"], flush=True)
    if not rank_zero:
        return
    worst = max(abs(expected / measured - 1) for measured, expected in rows)
    print(f"{len(rows)} layouts; largest deviation {worst:.1%} (target: within 10%)")


if __name__ == "__main__":
    run_on_ranks(main, WORLD_SIZE)
