"""Run on each rank: an MoE layer under expert parallelism vs the same layer on one process fed every
rank's tokens concatenated in rank order (the reference `MoE`, and a hand-written block whose experts are a
`ModuleList` of MLPs, through 3 SGD steps); and under expert tensor parallelism (each expert split over tp, the
same tokens on every tp rank) vs the same layer on one process, through 3 SGD steps
(tests/distributed/test_expert_parallel.py)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_nd.expert_parallel.dispatch import apply_ep
from lightning_nd.expert_parallel.lists import mark_expert_shares
from lightning_nd.nn.moe import MoE
from lightning_nd.runtime.clip import global_grad_norm
from lightning_nd.tensor_parallel.apply.experts import tp_slice

TOKENS, HIDDEN, INNER, EXPERTS = 12, 16, 24, 8


def _case(mesh, capacity_factor: float | None, top_k: int, dtype: torch.dtype) -> dict:
    group = mesh.get_group()
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(0)
    reference = MoE(HIDDEN, INNER, EXPERTS, top_k, capacity_factor=capacity_factor, shared_intermediate=8).to(dtype)
    parallel = copy.deepcopy(reference)
    apply_ep(parallel, mesh)
    generator = torch.Generator().manual_seed(1)
    # A skewed router, so capacity really drops tokens and experts get uneven loads.
    everything = torch.randn(ep * TOKENS, HIDDEN, generator=generator, dtype=dtype) + 1.5
    mine = everything[rank * TOKENS:(rank + 1) * TOKENS].clone().requires_grad_()
    full = everything.clone().requires_grad_()
    out, expected = parallel(mine), reference(full)
    out.square().sum().backward()
    expected.square().sum().backward()
    first = rank * (EXPERTS // ep)
    router_grad = parallel.gate.weight.grad.clone()
    shared_grad = parallel.shared_expert.down_proj.weight.grad.clone()
    for grad in (router_grad, shared_grad):  # replicated weights: each rank's tokens add their share
        dist.all_reduce(grad, group=group)
    local = slice(first, first + EXPERTS // ep)
    errors = {
        "output": (out - expected[rank * TOKENS:(rank + 1) * TOKENS]).abs().max().item(),
        "input_grad": (mine.grad - full.grad[rank * TOKENS:(rank + 1) * TOKENS]).abs().max().item(),
        "gate_up_grad": (parallel.experts.gate_up_proj.grad.to_local()
                         - reference.experts.gate_up_proj.grad[local]).abs().max().item(),
        "down_grad": (parallel.experts.down_proj.grad.to_local() - reference.experts.down_proj.grad[local]).abs().max().item(),
        "router_grad": (router_grad - reference.gate.weight.grad).abs().max().item(),
        "shared_grad": (shared_grad - reference.shared_expert.down_proj.weight.grad).abs().max().item(),
    }
    balance = torch.tensor(parallel.stats.load_balance_loss, dtype=torch.float64)
    dist.all_reduce(balance, group=group)
    return {
        "errors": errors,
        "tokens_per_expert": (parallel.stats.tokens_per_expert.tolist(), reference.stats.tokens_per_expert.tolist()),
        "dropped": (parallel.stats.dropped, reference.stats.dropped),
        "balance": (balance.item() / ep, reference.stats.load_balance_loss),
    }


def _tp_case(mesh, capacity_factor: float | None, top_k: int, dtype: torch.dtype, steps: int = 3) -> dict:
    """Each expert split over the tp ``mesh``; every tp rank feeds the same tokens (the outer ranks others)."""
    group = mesh.get_group()
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(0)
    reference = MoE(HIDDEN, INNER, EXPERTS, top_k, capacity_factor=capacity_factor, shared_intermediate=8).to(dtype)
    parallel = copy.deepcopy(reference)
    apply_ep(parallel, None, mesh)
    generator = torch.Generator().manual_seed(1 + dist.get_rank() // tp)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.01) for model in (parallel, reference)]
    errors: dict[str, float] = {}

    def worst(name: str, error: torch.Tensor) -> None:
        errors[name] = max(errors.get(name, 0.0), error.abs().max().item())

    for _ in range(steps):
        tokens = torch.randn(TOKENS, HIDDEN, generator=generator, dtype=dtype) + 1.5
        mine, full = tokens.clone().requires_grad_(), tokens.clone().requires_grad_()
        out, expected = parallel(mine), reference(full)
        out.square().sum().backward()
        expected.square().sum().backward()
        worst("output", out - expected)
        worst("input_grad", mine.grad - full.grad)
        for name in ("gate_up_proj", "down_proj"):
            whole = getattr(reference.experts, name).grad
            worst(f"{name}_grad", getattr(parallel.experts, name).grad.to_local() - tp_slice(name, whole, rank, tp))
        worst("router_grad", parallel.gate.weight.grad - reference.gate.weight.grad)  # whole on every tp rank
        worst("shared_grad", parallel.shared_expert.down_proj.weight.grad - reference.shared_expert.down_proj.weight.grad)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for name in ("gate_up_proj", "down_proj"):  # the DTensor means the whole stack, in the model's own order
        worst(f"{name}_after_steps", getattr(parallel.experts, name).full_tensor() - getattr(reference.experts, name))
    worst("router_after_steps", parallel.gate.weight - reference.gate.weight)
    return {
        "errors": errors,
        "tokens_per_expert": (parallel.stats.tokens_per_expert.tolist(), reference.stats.tokens_per_expert.tolist()),
        "dropped": (parallel.stats.dropped, reference.stats.dropped),
        "balance": (parallel.stats.load_balance_loss, reference.stats.load_balance_loss),
    }


class _MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, inner), nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(rows)) * self.w3(rows))


class ListMoE(nn.Module):
    """No library's block: a gate `Linear`, experts in a `ModuleList` called by index only when some token chose
    them, and a shared expert; softmax, top-k, renormalised."""

    def __init__(self, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(_MLP(HIDDEN, INNER) for _ in range(EXPERTS))
        self.shared = _MLP(HIDDEN, 8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, index = self.gate(hidden).softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = self.shared(hidden)
        for expert in index.unique().tolist():
            token, slot = torch.where(index == expert)
            out = out.index_add(0, token, self.experts[expert](hidden[token]) * weights[token, slot, None])
        return out


class _DroppingMLP(_MLP):
    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return F.dropout(super().forward(rows), 0.5)


class NoisyListMoE(ListMoE):
    """Routing that draws (jitter on the gate's input) and experts that draw (dropout inside each expert, which ep
    runs between the two passes): both passes must start from one random state, or the second routes differently
    and is refused."""

    def __init__(self) -> None:
        super().__init__(top_k=2)
        self.experts = nn.ModuleList(_DroppingMLP(HIDDEN, INNER) for _ in range(EXPERTS))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        noisy = hidden * (1 + 0.5 * torch.rand_like(hidden))
        weights, index = self.gate(noisy).softmax(-1).topk(self.top_k, dim=-1)
        out = self.shared(hidden)
        for expert in index.unique().tolist():
            token, slot = torch.where(index == expert)
            out = out.index_add(0, token, self.experts[expert](hidden[token]) * weights[token, slot, None])
        return out


def _noisy_list_case(mesh) -> str:
    """Two steps of `NoisyListMoE` under ep: "ok", or the refusal its second pass raised."""
    torch.manual_seed(dist.get_rank())
    model = NoisyListMoE()
    apply_ep(model, mesh)
    try:
        for _ in range(2):
            model(torch.randn(TOKENS, HIDDEN)).sum().backward()
    except RuntimeError as error:
        return str(error)
    return "ok"


def _list_case(mesh, top_k: int, dtype: torch.dtype, steps: int = 3) -> dict:
    """`ListMoE` under ep: this rank holds its E/ep experts, under their own names; 3 SGD steps."""
    group = mesh.get_group()
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(0)
    reference = ListMoE(top_k).to(dtype)
    parallel = copy.deepcopy(reference)
    apply_ep(parallel, mesh)
    mark_expert_shares(parallel)
    held = [name for name, _ in parallel.experts.named_children()]
    local = range(rank * EXPERTS // ep, (rank + 1) * EXPERTS // ep)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (parallel, reference)]
    generator = torch.Generator().manual_seed(1)
    errors: dict[str, float] = {}

    def worst(name: str, error: torch.Tensor) -> None:
        errors[name] = max(errors.get(name, 0.0), error.abs().max().item())

    for _ in range(steps):
        everything = torch.randn(ep * TOKENS, HIDDEN, generator=generator, dtype=dtype) + 1.5
        mine = everything[rank * TOKENS:(rank + 1) * TOKENS].clone().requires_grad_()
        full = everything.clone().requires_grad_()
        out, expected = parallel(mine), reference(full)
        (out.square().sum() / everything.numel()).backward()  # each rank's share of the mean square
        expected.square().mean().backward()
        worst("output", out - expected[rank * TOKENS:(rank + 1) * TOKENS])
        worst("input_grad", mine.grad - full.grad[rank * TOKENS:(rank + 1) * TOKENS])
        for name, param in parallel.named_parameters():
            if not name.startswith("experts."):  # replicated weights: each rank's tokens add their share
                dist.all_reduce(param.grad, group=group)
            expected_grad = reference.get_parameter(name).grad  # None for an expert no token chose: runs on none here
            worst(f"{name.split('.')[0]}_grad", param.grad - (0 if expected_grad is None else expected_grad))
        if dtype == torch.float32:  # what clipping sees (in fp32): each expert once, though each rank holds others
            worst("grad_norm", global_grad_norm(parallel.parameters())
                  - torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None]))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for name, param in parallel.named_parameters():
        worst(f"{name.split('.')[0]}_after_steps", param - reference.get_parameter(name))
    return {"errors": errors, "held": (held, [str(index) for index in local]),
            "expert_numel": (sum(p.numel() for p in parallel.experts.parameters()),
                             sum(p.numel() for p in reference.experts.parameters()) // ep)}


def run_all() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    meshes = {world: init_device_mesh("cpu", (world,)), 2: init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("outer", "ep"))["ep"]}
    results = {}
    for ep, group in sorted(meshes.items()):
        for capacity_factor in (None, 1.0):
            for top_k in (1, 2):
                for dtype in (torch.float64, torch.float32):
                    key = f"ep{ep}-cap{capacity_factor}-top{top_k}-{str(dtype)[6:]}"
                    results[key] = _case(group, capacity_factor, top_k, dtype)
        for top_k in (1, 2):
            for dtype in (torch.float64, torch.float32):
                results[f"list-ep{ep}-top{top_k}-{str(dtype)[6:]}"] = _list_case(group, top_k, dtype)
        results[f"noisy-ep{ep}"] = _noisy_list_case(group)
    tp_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("outer", "tp"))["tp"]
    for capacity_factor in (None, 1.0):
        for top_k in (1, 2):
            for dtype in (torch.float64, torch.float32):
                results[f"etp2-cap{capacity_factor}-top{top_k}-{str(dtype)[6:]}"] = _tp_case(tp_mesh, capacity_factor,
                                                                                               top_k, dtype)
    dist.destroy_process_group()
    return results
