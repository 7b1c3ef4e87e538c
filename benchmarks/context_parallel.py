"""Context parallelism on CPU: what ring attention keeps for backward per rank, against one device running the
fused kernel, at S = 2K, 8K, 16K and cp = 1, 2, 4; the causal work per rank; the time per rank at cp = 2.

    python benchmarks/context_parallel.py              # 4 CPU processes, about 4 minutes
    python benchmarks/context_parallel.py --quick      # S = 2K only

Attention of one sequence (8 heads, 2 kv-heads, head dim 64, fp32), causal, head-tail shards, forward and
backward. Memory kept for backward: a saved-tensors hook records every tensor autograd keeps, each storage
once, the inputs (q, k, v) included, K/V at the size they are stored (not expanded to the query heads); the worst
rank is reported. "fused/cp" is one device running torch's fused CPU kernel on the whole sequence (SDPA, flash
backend, grouped-query), divided by cp: the target is ring <= 1.15x of it. "model" is `lightning_nd.cost`'s
attention memory per rank (`attention_saved`) for the same tokens, against the measured. Under selective
recomputation (torch's MemTracker, activation memory after forward) the ring keeps its fused kernels' outputs as
well: measured against the model's count of them.

Work: query-key pairs each rank's kernels score (`context_parallel/block_pairs.py`: the diagonal sub-chunks by the causal
kernel, blocks above the diagonal skipped), max over mean (target <= 1.05 at cp = 4). Time: per-rank CPU time
of forward and backward at cp = 2, S = 8K, the median of interleaved repeats (both ranks run each repeat
together), and the slowest rank over the fastest (target <= 1.10).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.launch import run_on_ranks  # noqa: E402

WORLD_SIZE = 4
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
REPEATS = 5


def kept(run) -> int:
    """Bytes autograd keeps for backward while ``run()`` builds its graph; then runs the backward."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    out.square().mean().backward()
    return sum(seen.values())


def sequence(seq: int, positions: torch.Tensor | None = None) -> list[torch.Tensor]:
    """q, k, v of one sequence (the rows at ``positions``), as leaves."""
    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(1, heads, seq, HEAD_DIM, generator=generator) for heads in (HEADS, KV_HEADS, KV_HEADS)]
    return [(t if positions is None else t[:, :, positions]).clone().requires_grad_() for t in full]


def this_ranks_shard(seq: int, cp: int, group) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This rank's head-tail positions and its rows of q, k, v."""
    from lightning_nd.context_parallel.sharding import shard_positions

    positions = shard_positions(seq, cp, dist.get_rank(group))
    return positions, sequence(seq, positions)


def fused_one_device(seq: int) -> int:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = sequence(seq)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return kept(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                             enable_gqa=True))


def ring(seq: int, cp: int, group) -> int:
    from lightning_nd.context_parallel.ring_attention import ring_attention
    positions, (q, k, v) = this_ranks_shard(seq, cp, group)
    return kept(lambda: ring_attention(q, k, v, positions, group, causal=True))


def selective_extra(seq: int, cp: int, group) -> int:
    """Bytes the ring keeps beyond its own saved tensors when selective recomputation checkpoints it (the policy
    keeps the fused kernels' outputs): activation memory after forward under the policy, less without it."""
    from functools import partial

    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from lightning_nd.context_parallel.ring_attention import ring_attention
    from lightning_nd.parallel.activation import _selective_policy
    positions, (q, k, v) = this_ranks_shard(seq, cp, group)
    kept = []
    for selective in (False, True):
        def attend(*qkv):
            return ring_attention(*qkv, positions, group, causal=True)

        with MemTracker() as tracker:
            out = (checkpoint(attend, q, k, v, use_reentrant=False,
                              context_fn=partial(create_selective_checkpoint_contexts, _selective_policy))
                   if selective else attend(q, k, v))
            kept.append(next(iter(tracker.get_tracker_snapshot().values())).get("Activation", 0))
        out.sum().backward()
    return kept[1] - kept[0]


def model_bytes(seq: int, cp: int, recompute: str = "none") -> int:
    from lightning_nd.cost.activations import attention_saved
    from lightning_nd.cost.shape import ModelShape

    shape = ModelShape(hidden=HEADS * HEAD_DIM, layers=1, heads=HEADS, kv_heads=KV_HEADS, intermediate=0, vocab=0,
                       params=0)
    saved = attention_saved(shape, 4, cp, recompute)
    if recompute == "selective":  # beyond what the ring saves itself (and the projections, outside attention)
        saved = tuple(s for s in saved if s.what.startswith("each ring block"))
    return sum(seq // cp * s.elements * s.bytes for s in saved)


def work(seq: int, cp: int) -> list[int]:
    from lightning_nd.context_parallel.block_pairs import block_pairs
    from lightning_nd.context_parallel.sharding import every_shard_positions

    shards = every_shard_positions(seq, cp)
    return [sum(pair.work for source in shards for pair in block_pairs(shards[rank], source, causal=True))
            for rank in range(cp)]


def cpu_seconds(seq: int, cp: int, group) -> float:
    from lightning_nd.context_parallel.ring_attention import ring_attention
    positions, (q, k, v) = this_ranks_shard(seq, cp, group)
    dist.barrier()
    start = time.process_time()
    ring_attention(q, k, v, positions, group, causal=True).square().mean().backward()
    return time.process_time() - start


def worst(value: float) -> float:
    measured = torch.tensor(float(value))
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    return float(measured)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    seqs = (2048,) if parser.parse_args().quick else (2048, 8192, 16384)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(WORLD_SIZE)]
    groups = {1: singles[rank], 2: pairs[rank // 2], 4: dist.group.WORLD}
    rows = []
    for seq in seqs:
        fused = worst(fused_one_device(seq) if rank == 0 else 0)
        for cp in (1, 2, 4):
            measured = worst(ring(seq, cp, groups[cp]))
            rows.append((seq, cp, measured, fused / cp, model_bytes(seq, cp)))
    selective = [(cp, worst(selective_extra(2048, cp, groups[cp]))) for cp in (2, 4)]
    timed_seq = seqs[-1] if len(seqs) == 1 else 8192
    times = [cpu_seconds(timed_seq, 2, groups[2]) for _ in range(REPEATS)]
    medians = [torch.zeros(1) for _ in range(WORLD_SIZE)]
    dist.all_gather(medians, torch.tensor([statistics.median(times)]))
    if rank == 0:
        print("\nAttention memory kept for backward per rank (worst rank), MB;"
              " fused/cp: one device's fused kernel / cp")
        print(f"{'S':>6} {'cp':>3} {'ring':>9} {'fused/cp':>9} {'ring/(fused/cp)':>16} {'model':>9} {'model/ring':>11}")
        for seq, cp, measured, target, model in rows:
            print(f"{seq:>6} {cp:>3} {measured / 2**20:>9.2f} {target / 2**20:>9.2f} {measured / target:>16.3f}"
                  f" {model / 2**20:>9.2f} {model / measured:>11.3f}")
        print("\nUnder selective recomputation, S = 2048: kept beyond the ring's own tensors (worst rank), MB")
        for cp, measured in selective:
            model = model_bytes(2048, cp, "selective")
            print(f"cp={cp}: measured {measured / 2**20:.2f}, model {model / 2**20:.2f}, model/measured"
                  f" {model / measured:.3f}")
        print(f"\nCausal work per rank (query-key pairs scored), S = {timed_seq}, head-tail shards")
        for cp in (2, 4):
            pairs_per_rank = work(timed_seq, cp)
            mean = sum(pairs_per_rank) / cp
            print(f"cp={cp}: {pairs_per_rank}  max/mean {max(pairs_per_rank) / mean:.3f}")
        seconds = [float(m) for m in medians[:2]]
        print(f"\nCPU time per rank, forward + backward, cp=2, S = {timed_seq}, median of {REPEATS} repeats:"
              f" rank 0 {seconds[0]:.2f} s, rank 1 {seconds[1]:.2f} s;"
              f" slowest/fastest {max(seconds) / min(seconds):.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    run_on_ranks(main, WORLD_SIZE)
