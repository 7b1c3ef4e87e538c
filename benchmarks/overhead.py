"""Step time of NDParallel in Lightning vs the same layout hand-written (plain torch loop, and Lightning's
ModelParallelStrategy with a hand-written `configure_model`), interleaved, on 4 CPU processes; and NDParallel
with a callback listening to every strategy event (`strategy/events.py`) vs none ("events" column: the cost
of being observed; the NDParallel column is the unobserved run, whose events are never built).

    python benchmarks/overhead.py                      # CPU, gloo
    python benchmarks/overhead.py --accelerator=cuda   # 4 GPUs, nccl (gpu_check.sh)

Each round runs every variant for the same number of steps on a fresh copy of the same model and data;
a step's time is the wall time between the starts of consecutive steps (everything the loop does),
after two warm-up steps. Medians over all rounds; ratios are NDParallel / other (<= 1.0 is faster).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import MODEL_CONFIG, Bench, StepTimer, build_model  # noqa: E402
from benchmarks.launch import run_on_ranks  # noqa: E402

WORLD_SIZE = 4
ROUNDS, STEPS, WARMUP = 3, 8, 2
BATCH, SEQ = 4, 128
LAYOUTS = {"dp_shard=4": (1, 4, 1), "tp=4": (1, 1, 4), "dp_shard=2 x tp=2": (1, 2, 2),
           "pp=2 x dp_shard=2": (2, 2, 1)}  # (pp, dp_shard, tp)
MICROBATCHES = 4  # under pp: 2 x pp, NDParallel's default
TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
           "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
           "mlp.down_proj": "rowwise"}


def batches(dp_rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(dp_rank)
    tokens = torch.randint(MODEL_CONFIG["vocab_size"], (count, BATCH, SEQ + 1), generator=generator)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def parallelize_by_hand(model, dp_mesh, tp_mesh) -> None:
    """What a user writes without lightning-nd: TP plan per layer, then FSDP per layer and the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if tp_mesh.size() > 1:
        for layer in model.layers:
            parallelize_module(layer, tp_mesh, {name: styles[style]() for name, style in TP_PLAN.items()})
        parallelize_module(model, tp_mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                                            "lm_head": ColwiseParallel(output_layouts=Replicate())})
    if dp_mesh.size() > 1:
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)


ACCELERATOR = "cuda" if "--accelerator=cuda" in sys.argv else "cpu"


class EveryEvent:
    """A listener on every event that keeps nothing: what subscribing costs the strategy."""

    def __init__(self) -> None:
        from lightning_nd.strategy.events import ALL_EVENTS

        for event in ALL_EVENTS:
            setattr(self, event.hook, lambda strategy, event: None)


def lightning_run(strategy, module: Bench, data, listen: bool = False) -> list[float]:
    from lightning.pytorch import Callback

    timer = StepTimer(WARMUP)
    listener = type("Listener", (EveryEvent, Callback), {})() if listen else None
    trainer = Trainer(strategy=strategy, accelerator=ACCELERATOR, devices=WORLD_SIZE, max_steps=len(data), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[timer, *([listener] if listener else [])], use_distributed_sampler=False)
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=None))
    return timer.step_times


class HandStage(torch.nn.Module):
    """A hand-written pipeline stage of the benchmark Llama: [embedding] + its layers [+ norm + head]."""

    def __init__(self, model, stage: int, stages: int) -> None:
        super().__init__()
        per_stage = len(model.layers) // stages
        self.embed = model.embed_tokens if stage == 0 else None
        self.layers = torch.nn.ModuleList(model.layers[stage * per_stage:(stage + 1) * per_stage])
        self.norm, self.head = (model.norm, model.lm_head) if stage == stages - 1 else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        x = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            x = layer(x, positions)
        return self.head(self.norm(x)) if self.head is not None else x


def pipeline_by_hand(model, pp_mesh, dp_mesh, device):
    """What a user writes with torch.distributed.pipelining: cut the model, FSDP per stage, a 1F1B schedule."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage_index = pp_mesh.get_local_rank()
    stage = HandStage(model, stage_index, pp_mesh.size())
    for layer in stage.layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False)
    pipe = PipelineStage(stage, stage_index, pp_mesh.size(), device, group=pp_mesh.get_group())
    loss = lambda logits, labels: F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())  # noqa: E731
    return stage, Schedule1F1B(pipe, n_microbatches=MICROBATCHES, loss_fn=loss)


def torch_run(pp: int, dp_shard: int, tp: int, data) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(ACCELERATOR, int(os.environ["LOCAL_RANK"])) if ACCELERATOR == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(ACCELERATOR, (pp, dp_shard, tp), mesh_dim_names=("pp", "dp", "tp"))
    model = build_model().to(device)
    if pp > 1:
        model, schedule = pipeline_by_hand(model, mesh["pp"], mesh["dp"], device)
        first, last = mesh["pp"].get_local_rank() == 0, mesh["pp"].get_local_rank() == pp - 1
    else:
        parallelize_by_hand(model, mesh["dp"], mesh["tp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    starts = []
    for tokens, labels in data:
        tokens, labels = tokens.to(device), labels.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        starts.append(time.perf_counter())
        optimizer.zero_grad()
        if pp > 1:
            schedule.step(*([tokens] if first else []), **({"target": labels, "losses": []} if last else {}))
        else:
            F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
        optimizer.step()
    starts.append(time.perf_counter())
    return [b - a for a, b in zip(starts, starts[1:])][WARMUP:]


def main() -> None:
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_nd import NDParallel

    rank = int(os.environ["RANK"])
    rows = []
    for name, (pp, dp_shard, tp) in LAYOUTS.items():
        times: dict[str, list[float]] = {"NDParallel": [], "plain torch": [], "ModelParallelStrategy": [],
                                         "events": []}
        data = batches((rank // tp) % dp_shard, STEPS + WARMUP)
        for _ in range(ROUNDS):
            strategy = NDParallel(pp=pp, dp_shard=dp_shard, tp=tp, pp_microbatches=MICROBATCHES if pp > 1 else None)
            times["NDParallel"] += lightning_run(strategy, Bench(build_model), data)
            listened = NDParallel(pp=pp, dp_shard=dp_shard, tp=tp, pp_microbatches=MICROBATCHES if pp > 1 else None)
            times["events"] += lightning_run(listened, Bench(build_model), data, listen=True)
            times["plain torch"] += torch_run(pp, dp_shard, tp, data)
            if pp > 1:  # Lightning's ModelParallelStrategy has no pipeline parallelism
                continue
            mps = ModelParallelStrategy(data_parallel_size=dp_shard, tensor_parallel_size=tp)
            by_hand = Bench(build_model, configure=lambda model, mesh: parallelize_by_hand(
                model, mesh["data_parallel"], mesh["tensor_parallel"]))
            times["ModelParallelStrategy"] += lightning_run(mps, by_hand, data)
        rows.append((name, {variant: statistics.median(values) if values else float("nan")
                            for variant, values in times.items()}))
        dist.barrier()
    if rank == 0:
        print(f"\n{'layout':20} {'NDParallel':>11} {'plain torch':>12} {'MPS':>9} {'vs torch':>9} {'vs MPS':>8}"
              f" {'events/none':>12}")
        for name, median in rows:
            nd, plain, mps = median["NDParallel"], median["plain torch"], median["ModelParallelStrategy"]
            print(f"{name:20} {nd * 1e3:>9.1f}ms {plain * 1e3:>10.1f}ms {mps * 1e3:>7.1f}ms {nd / plain:>9.3f} {nd / mps:>8.3f}"
                  f" {median['events'] / nd:>12.3f}")
        print("(MPS: Lightning's ModelParallelStrategy has no pipeline parallelism: nan)")
        worst = max(m["NDParallel"] / m["plain torch"] for _, m in rows)
        print(f"max overhead vs plain torch (target <= 1.03): {worst:.3f}")


if __name__ == "__main__":
    run_on_ranks(main, WORLD_SIZE)
