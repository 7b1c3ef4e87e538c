"""Per-rank model-state memory vs the theoretical share of each layout, on 4 CPU processes.

    python benchmarks/memory.py

Model state = parameters + gradients + AdamW moments (exp_avg, exp_avg_sq) a rank holds, summed over
its local shards after one optimizer step through `Trainer(strategy=NDParallel(...))` (AdamW's 0-dim
step counters are left out of both sides). Theoretical share = the same state for the whole,
unsharded model divided by how many ways the layout splits it (dp_shard x cp x tp x pp; replicas of
HSDP/DDP hold a full share each; pipeline stages hold whole blocks, so pp=4 over 4 blocks cannot split
the embedding and head evenly). The ratio is the worst rank's bytes over that share.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import state_bytes  # noqa: E402
from benchmarks.launch import run_on_ranks  # noqa: E402

WORLD_SIZE = 4
LAYOUTS = {
    "dp_shard=4 (zero 3)": {"dp_shard": 4},
    "dp_shard=4 (zero 2)": {"dp_shard": 4, "zero_stage": 2},
    "dp_replicate=2 x dp_shard=2": {"dp_replicate": 2, "dp_shard": 2},
    "dp_replicate=4 (ddp)": {"dp_replicate": 4, "dp_shard": 1},
    "tp=4": {"tp": 4},
    "tp=4 + sp": {"tp": 4, "sequence_parallel": True},
    "dp_shard=2 x tp=2": {"dp_shard": 2, "tp": 2},
    "pp=2 x dp_shard=2": {"pp": 2, "dp_shard": 2},
    "pp=4": {"pp": 4, "dp_shard": 1},
    "cp=2 x dp_shard=2": {"cp": 2, "dp_shard": 2},
}


class StateBytes(Callback):
    """Model-state bytes on this rank once training ends (the grads of the last step are still there)."""

    def on_train_end(self, trainer, pl_module) -> None:
        self.bytes = state_bytes(list(pl_module.parameters()), trainer.optimizers[0])


def measure(layout: dict) -> tuple[int, float]:
    from examples.data import TokenDataModule
    from examples.lit import CausalLM
    from examples.models.llama import Llama, LlamaConfig
    from lightning_nd import NDParallel

    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4)
    probe = StateBytes()
    trainer = Trainer(strategy=NDParallel(**layout), accelerator="cpu", devices=WORLD_SIZE, max_steps=1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, callbacks=[probe])
    trainer.fit(CausalLM(model_factory=lambda: Llama(config)),
                datamodule=TokenDataModule(vocab_size=1024, seq_len=32, num_samples=64, batch_size=8))
    worst = torch.tensor(probe.bytes)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    with torch.device("meta"):
        total = sum(p.numel() for p in Llama(config).parameters()) * 4 * 4  # fp32 param, grad, 2 moments
    dims = trainer.strategy.dims
    return int(worst), total / (dims.dp_shard * dims.cp * dims.tp * dims.pp)


def main() -> None:
    rows = [(name, *measure(layout)) for name, layout in LAYOUTS.items()]
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"\n{'layout':32} {'bytes/rank (max)':>18} {'theoretical share':>18} {'ratio':>7}")
        for name, measured, share in rows:
            print(f"{name:32} {measured:>18,} {share:>18,.0f} {measured / share:>7.3f}")
        print(f"max ratio (target <= 1.02): {max(measured / share for _, measured, share in rows):.3f}")


if __name__ == "__main__":
    run_on_ranks(main, WORLD_SIZE)
