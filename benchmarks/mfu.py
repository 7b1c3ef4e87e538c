"""Model FLOPs utilisation of a ~0.9B-parameter Llama-style model on one GPU through NDParallel.

    python benchmarks/mfu.py                    # CUDA, bf16-mixed, selective activation checkpointing
    python benchmarks/mfu.py --tiny --accelerator cpu   # the same code path on a tiny model

MFU = (6 N + 12 L d s) tokens/s / peak FLOP/s, with N parameters, L layers, width d, sequence s
(the PaLM accounting); --peak-tflops defaults to 989, the dense bf16 peak of an H100/H200 SXM.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Bench, StepTimer  # noqa: E402
from examples.models.llama import Llama, LlamaConfig  # noqa: E402
from lightning_nd import NDParallel  # noqa: E402

BIG = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=8)
TINY = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, to check the code path anywhere")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    args = parser.parse_args()
    config, seq = (TINY, 64) if args.tiny else (BIG, args.seq)
    tokens = torch.randint(config.vocab_size, (args.steps, args.batch, seq + 1))
    data = DataLoader([(t[:, :-1], t[:, 1:]) for t in tokens], batch_size=None)
    timer = StepTimer(warmup=2)
    trainer = Trainer(strategy=NDParallel(dp_shard=1, activation_checkpointing="selective"),
                      accelerator=args.accelerator, devices=1, max_steps=args.steps,
                      precision="bf16-mixed", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[timer], use_distributed_sampler=False)
    module = Bench(lambda: Llama(config), in_configure_model=True)
    trainer.fit(module, train_dataloaders=data)
    step = sorted(timer.step_times)[len(timer.step_times) // 2]
    params = sum(p.numel() for p in module.model.parameters())
    flops_per_token = 6 * params + 12 * config.num_hidden_layers * config.hidden_size * seq
    tokens_per_s = args.batch * seq / step
    print(f"params {params / 1e9:.2f}B, step {step * 1e3:.1f} ms, {tokens_per_s:,.0f} tokens/s,"
          f" MFU {flops_per_token * tokens_per_s / (args.peak_tflops * 1e12):.3f} of {args.peak_tflops:g} TFLOP/s")


if __name__ == "__main__":
    main()
