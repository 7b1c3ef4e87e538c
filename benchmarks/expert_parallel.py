"""All-to-all bytes of expert parallelism per step next to the analytic minimum, on 4 CPU processes.

    python benchmarks/expert_parallel.py

One MoE layer (8 SwiGLU experts, top-2, hidden 256) under ep=2 and ep=4, 4 x 128 tokens per rank, one
forward and backward. Every all-to-all the layer issues is seen by a dispatch mode; the bytes a rank
sends to *other* ranks are counted (rows kept on the rank move nothing). The analytic minimum per
direction (dispatch, and combine the same again; backward repeats both for the gradients):
tokens x top-k x hidden x bytes x (ep-1)/ep, for routing spread evenly over the experts. The small
count exchanges (per-expert counts, totals) are listed apart.

Expert tensor parallelism (each expert split over tp, `lightning_nd/tensor_parallel/apply/experts.py`) at ep=2 x tp=2: every
tp rank routes the same tokens, so its all-to-all bytes are ep=2's; beside them the tp all-reduces of the experts'
partial outputs (forward) and of their input gradients (backward) are counted, each against its payload minimum,
rows received x hidden x bytes (one all-reduce of the rows each way).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import tensors_in  # noqa: E402
from benchmarks.launch import run_on_ranks  # noqa: E402

WORLD_SIZE = 4
TOKENS, HIDDEN, INNER, EXPERTS, TOP_K = 4 * 128, 256, 512, 8, 2


class AllToAllBytes(TorchDispatchMode):
    """Bytes this rank sends to other ranks in all-to-alls, by phase; all-reduces of token rows (ETP's partial
    sums, ``[rows, HIDDEN]``) by phase; other collectives' bytes apart."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.sent: dict[str, int] = defaultdict(int)
        self.reduced: dict[str, int] = defaultdict(int)
        self.other = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__
        if "all_to_all_single" in name and func.namespace == "_c10d_functional":
            tensor, input_splits, group = args[0], args[2], args[3]
            rank = dist.get_rank(dist.distributed_c10d._resolve_process_group(group))
            row = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
            self.sent[self.phase] += (sum(input_splits) - input_splits[rank]) * row
        elif func.namespace == "c10d" and "barrier" not in name:  # count exchange, totals (c10d ops box lists)
            tensors = tensors_in(args)
            rows = [t for t in tensors if t.ndim == 2 and t.shape[-1] == HIDDEN]
            self.reduced[self.phase] += sum(t.numel() * t.element_size() for t in rows)
            self.other += sum(t.numel() * t.element_size() for t in tensors if t.ndim != 2 or t.shape[-1] != HIDDEN)
        return out


def measure(mesh, seed: int) -> AllToAllBytes:
    """One forward and backward of the layer split over ``mesh`` (ep, or (ep, tp)); ``seed``: this rank's tokens."""
    from lightning_nd.expert_parallel.dispatch import apply_ep
    from lightning_nd.nn.moe import MoE

    torch.manual_seed(0)
    layer = MoE(HIDDEN, INNER, EXPERTS, TOP_K)
    apply_ep(layer, mesh)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    mode = AllToAllBytes()
    with mode:
        out = layer(x)
        mode.phase = "backward"
        out.square().mean().backward()
    return mode


def expert_tp_row(rank: int) -> tuple[float, ...]:
    """ep=2 x tp=2: mean bytes per rank of all-to-alls and tp all-reduces, each way, and their minimum."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    mode = measure(mesh, seed=mesh.get_coordinate()[0])  # one token set per tp pair (replicated over tp)
    totals = torch.tensor([mode.sent.get("forward", 0), mode.sent.get("backward", 0), mode.reduced.get("forward", 0),
                           mode.reduced.get("backward", 0)], dtype=torch.float64)
    dist.all_reduce(totals)
    return tuple((totals / WORLD_SIZE).tolist())


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = []
    for ep in (2, 4):
        mesh = init_device_mesh("cpu", (WORLD_SIZE // ep, ep), mesh_dim_names=("outer", "ep"))["ep"]
        mode = measure(mesh, seed=rank)
        totals = torch.tensor([mode.sent.get("forward", 0), mode.sent.get("backward", 0), mode.other],
                              dtype=torch.float64)
        dist.all_reduce(totals)
        minimum = 2 * TOKENS * TOP_K * HIDDEN * 4 * (ep - 1) / ep  # dispatch + combine
        rows.append((ep, totals[0].item() / WORLD_SIZE, totals[1].item() / WORLD_SIZE, totals[2].item() / WORLD_SIZE,
                     minimum))
    etp = expert_tp_row(rank)
    if rank == 0:
        print(f"\n{'ep':>3} {'forward bytes':>14} {'backward bytes':>15} {'minimum/pass':>13} {'fwd ratio':>10}"
              f" {'bwd ratio':>10} {'counts etc.':>12}")
        for ep, forward, backward, other, minimum in rows:
            print(f"{ep:>3} {forward:>14,.0f} {backward:>15,.0f} {minimum:>13,.0f} {forward / minimum:>10.3f}"
                  f" {backward / minimum:>10.3f} {other:>12,.0f}")
        print("mean bytes per rank; forward = dispatch + combine, backward = their gradients; minimum assumes"
              " routing spread evenly")
        print(f"forward all-to-all bytes / analytic minimum: {', '.join(f'ep={r[0]} {r[1] / r[4]:.3f}' for r in rows)}")
        minimum, payload = rows[0][4], TOKENS * TOP_K * HIDDEN * 4  # ep=2's all-to-all; rows received x hidden
        print(f"ep=2 x tp=2 (experts split over tp): all-to-all forward {etp[0]:,.0f} ({etp[0] / minimum:.3f} x ep=2's"
              f" minimum), backward {etp[1]:,.0f} ({etp[1] / minimum:.3f}); tp all-reduce payload forward"
              f" {etp[2]:,.0f} ({etp[2] / payload:.3f} x rows x hidden x 4), backward {etp[3]:,.0f}"
              f" ({etp[3] / payload:.3f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    run_on_ranks(main, WORLD_SIZE)
