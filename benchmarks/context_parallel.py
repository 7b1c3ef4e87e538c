"""Context parallelism at a long sequence on CPU: attention memory per rank for cp=1, 2, 4, and the
balance of causal attention work for contiguous vs zigzag sequence sharding.

    python benchmarks/context_parallel.py

Memory: ring attention's forward and backward over one sequence of SEQ tokens (8 heads, 2 kv-heads,
head dim 64, fp32) on each rank of a cp group holding a zigzag shard; what autograd keeps for backward
(the attention's activation memory, which dominates at long sequences) is counted by a saved-tensors
hook, unique storages once, and the worst rank is reported. Work: query-key pairs a rank must score
under the causal mask (proportional to its attention FLOPs when masked blocks are skipped), max over
ranks / mean over ranks at cp=4.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.launch import run_on_ranks  # noqa: E402

WORLD_SIZE = 4
SEQ, HEADS, KV_HEADS, HEAD_DIM = 2048, 8, 2, 64


def saved_bytes(cp: int, group) -> int:
    """Bytes autograd keeps for backward in this rank's ring attention over its shard."""
    from lightning_nd.nn.ring_attention import ring_attention
    from lightning_nd.parallel.context.sharding import shard_positions

    rank = dist.get_rank(group)
    positions = shard_positions(SEQ, cp, rank, "zigzag")
    generator = torch.Generator().manual_seed(0)
    full_q = torch.randn(1, HEADS, SEQ, HEAD_DIM, generator=generator)
    full_kv = torch.randn(2, 1, KV_HEADS, SEQ, HEAD_DIM, generator=generator)
    q = full_q[:, :, positions].clone().requires_grad_()
    k, v = (t[:, :, positions].clone().requires_grad_() for t in full_kv)
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = ring_attention(q, k, v, positions, group, causal=True)
    out.square().mean().backward()
    return sum(seen.values())


def main() -> None:
    from lightning_nd.parallel.context.sharding import attention_flops_per_rank

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = []
    for cp in (1, 2, 4):
        group = dist.new_group(list(range(cp)))
        measured = torch.tensor(saved_bytes(cp, group) if rank < cp else 0)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        rows.append((cp, int(measured)))
    if rank == 0:
        base = rows[0][1]
        print(f"\nattention memory kept for backward, seq={SEQ}, worst rank")
        print(f"{'cp':>3} {'bytes/rank':>14} {'x of cp=1':>10} {'1/cp':>6}")
        for cp, measured in rows:
            print(f"{cp:>3} {measured:>14,} {measured / base:>10.3f} {1 / cp:>6.3f}")
        print(f"\ncausal attention work per rank at cp={WORLD_SIZE}, seq={SEQ} (query-key pairs scored)")
        for sharding in ("contiguous", "zigzag"):
            work = attention_flops_per_rank(SEQ, WORLD_SIZE, sharding)
            print(f"{sharding:>10}: {work}  max/mean {max(work) * len(work) / sum(work):.3f}")
        zigzag = attention_flops_per_rank(SEQ, WORLD_SIZE, "zigzag")
        print(f"memory cp=4 vs cp=1: {rows[-1][1] / base:.3f} (expect ~0.25); zigzag max/mean work:"
              f" {max(zigzag) * len(zigzag) / sum(zigzag):.3f} (expect ~1.0)")
    dist.destroy_process_group()


if __name__ == "__main__":
    run_on_ranks(main, WORLD_SIZE)
