"""Collective bytes per training step by mesh dim vs the analytic minimum of the layout (4 CPU processes).

    python benchmarks/comm_volume.py
    COMM_LAYOUTS="tp=4,dp_shard=2 x tp=2 (moe)" python benchmarks/comm_volume.py   # some layouts only

Every collective a rank issues during one step (FSDP's all-gathers and reduce-scatters, TP's
all-reduces, ...) is seen by a dispatch mode and charged to the mesh dim whose process group it used,
as the bytes a ring algorithm moves per rank: all-reduce 2B(n-1)/n, all-gather and reduce-scatter
B(n-1)/n (B = the full tensor); point-to-point: the bytes a rank sends; all-to-all: the rows it sends to
the others. The analytic minimum per dim is the cost model's `comm_per_step` on the run's own Layout
(`lightning_nd/cost/comm.py` states each dim's formula). Dims whose groups hold the same ranks (ep borrowing all
of dp_shard: ``fsdp+ep``) are one row: the collectives cannot tell them apart.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import tensors_in  # noqa: E402
from benchmarks.launch import run_on_ranks  # noqa: E402

WORLD_SIZE = 4
BATCH, SEQ = 2, 32
CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4)
LAYOUTS = {
    "dp_shard=4 (zero 3)": {"dp_shard": 4},
    "dp_shard=4 (zero 2)": {"dp_shard": 4, "zero_stage": 2},
    "dp_replicate=2 x dp_shard=2": {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 2},
    "tp=4": {"tp": 4},
    "tp=4 + sp": {"tp": 4, "sequence_parallel": True},
    "dp_shard=2 x tp=2": {"dp_shard": 2, "tp": 2, "zero_stage": 2},
    "pp=2 x dp_shard=2": {"pp": 2, "dp_shard": 2, "pp_microbatches": 2},
    "cp=2 x dp_shard=2": {"cp": 2, "dp_shard": 2, "zero_stage": 2},
    "ep=2 x dp_shard=4 (moe)": {"ep": 2, "dp_shard": 4, "zero_stage": 2},
    "dp_shard=2 x tp=2 (moe)": {"dp_shard": 2, "tp": 2, "zero_stage": 2},  # every expert split over tp
    "ep=2 x dp_shard=2 x tp=2 (moe)": {"ep": 2, "dp_shard": 2, "tp": 2, "zero_stage": 2},  # split both ways
}
MOE = {"num_experts": 8, "num_experts_per_tok": 2}  # the model of the "(moe)" layouts: every MLP 8 experts


class CollectiveBytes(TorchDispatchMode):
    """Ring bytes per rank of every c10d collective, keyed by the ranks of its process group."""

    def __init__(self) -> None:
        super().__init__()
        self.by_group: dict[tuple[int, ...], float] = defaultdict(float)
        self.by_kind: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__
        if func.namespace in ("c10d", "_c10d_functional") and "barrier" not in name:
            group = _group_of(args)
            if group is not None and len(group) > 1:
                moved = _ring_bytes(name, args, out, len(group))
                if "all_to_all_single" in name:  # the rows this rank sends to the others
                    splits, row = args[2], args[0][0].numel() * args[0].element_size() if args[0].shape[0] else 0
                    moved = (sum(splits) - splits[group.index(dist.get_rank())]) * row
                self.by_group[group] += moved
                self.by_kind[name] += moved
        return out


def _group_of(args) -> tuple[int, ...] | None:
    for arg in reversed(args):
        if isinstance(arg, str) and arg:  # functional collectives name their group last
            return tuple(dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(arg)))
        if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):  # c10d ops: the group, boxed
            return tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(arg)))
    return None


def _ring_bytes(name: str, args, out, n: int) -> float:
    if name.startswith(("send", "recv")):  # point-to-point: the bytes a rank sends
        return sum(t.numel() * t.element_size() for t in tensors_in(args)) if name.startswith("send") else 0.0
    full = max((t.numel() * t.element_size() for t in tensors_in(args) + tensors_in(out)), default=0)
    factor = 2 if "allreduce" in name or "all_reduce" in name else 1
    return factor * full * (n - 1) / n


class OneStep(Callback):
    """Counts the collectives of the second step (the first also builds optimizer state)."""

    def __init__(self) -> None:
        self.mode = CollectiveBytes()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 1:
            self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 1:
            self.mode.__exit__(None, None, None)


def dims_of(layout: dict) -> int:
    """Batch ranks of a layout (the sampler's replicas): the world size over pp, tp and cp."""
    return WORLD_SIZE // (layout.get("pp", 1) * layout.get("tp", 1) * layout.get("cp", 1))


def measure(layout: dict, moe: bool = False) -> dict[str, tuple[float, float]]:
    from examples.data import TokenDataModule
    from examples.lit import CausalLM
    from examples.models.llama import Llama, LlamaConfig
    from lightning_nd import NDParallel
    from lightning_nd.cost.comm import comm_per_step
    from lightning_nd.cost.shape import Workload, model_shape

    probe = OneStep()
    trainer = Trainer(strategy=NDParallel(**layout), accelerator="cpu", devices=WORLD_SIZE, max_steps=2,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, callbacks=[probe])
    config = LlamaConfig(**CONFIG, **(MOE if moe else {}))
    torch.manual_seed(0)  # one model on every rank: tp ranks must route alike when experts are split over tp
    module = CausalLM(model=Llama(config))
    trainer.fit(module, datamodule=TokenDataModule(
        vocab_size=CONFIG["vocab_size"], seq_len=SEQ, num_samples=BATCH * dims_of(layout) * 2, batch_size=BATCH))
    with torch.device("meta"):
        shape = model_shape(Llama(config))
    minimum = comm_per_step(trainer.strategy.layout, shape, Workload(seq_len=SEQ, batch=BATCH), dist.get_rank())
    mesh = trainer.strategy.device_mesh
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for dim in minimum:  # dims over the same ranks (ep borrowing all of dp_shard) share their groups' traffic
        by_ranks.setdefault(tuple(sorted(mesh.ranks(dim))), []).append(dim)
    rows = {"+".join(dims): (probe.mode.by_group.get(ranks, 0.0), sum(minimum[dim].bytes for dim in dims))
            for ranks, dims in by_ranks.items()}
    if int(os.environ.get("RANK", 0)) == 0 and os.environ.get("COMM_DETAIL"):
        print(layout, {k: int(v) for k, v in probe.mode.by_kind.items()})
    return rows


def main() -> None:
    only = os.environ.get("COMM_LAYOUTS")  # a comma-separated subset of the layouts' names, to run those alone
    chosen = {name: layout for name, layout in LAYOUTS.items() if not only or name in only.split(",")}
    results = {name: measure(layout, moe="(moe)" in name) for name, layout in chosen.items()}
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"\n{'layout':28} {'dim':>13} {'bytes/rank/step':>16} {'analytic minimum':>17} {'ratio':>7}")
        ratios = []
        for name, rows in results.items():
            for dim, (measured, minimum) in rows.items():
                ratios.append(measured / minimum)
                print(f"{name:28} {dim:>13} {measured:>16,.0f} {minimum:>17,.0f} {measured / minimum:>7.3f}")
        print(f"max ratio over dims (target 1.00): {max(ratios):.3f}")


if __name__ == "__main__":
    run_on_ranks(main, WORLD_SIZE)
