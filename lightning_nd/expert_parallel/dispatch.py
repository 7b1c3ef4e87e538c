"""Expert parallelism: each rank of an ep group holds E/ep of a layer's experts; tokens travel to them
and back with two all-to-alls (uneven splits, differentiable).

``apply_ep(model, ep_mesh)`` replaces every experts module that follows the Hugging Face convention
(stacked ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], called as ``experts(hidden, index,
weights)``: `lightning_nd.nn.moe.GroupedExperts` and e.g. Mixtral's) by an `ExpertParallel` holding
this rank's slice. Dispatch sorts the (token, slot) pairs by expert, so each destination's share is
contiguous; the owner regroups what it receives by expert with senders in rank order, which is the
order one process would see with every rank's tokens concatenated: a capacity limit (computed from the
global token count) drops exactly the assignments one process drops. Routing weights are applied by
the sender after the return trip, so the router's gradient stays local. ``last_counts`` are global
(summed over the group), so the load-balancing loss of each rank uses the global expert fractions and
the mean over ranks equals the one-process loss. The expert weights are DTensors sharded over ep
(dim 0), so checkpoints hold every expert once and `full_tensor()` gives the whole stack.

With a tp mesh instead (expert tensor parallelism, `lightning_nd.tensor_parallel.apply.experts`), every rank holds every
expert, each split over tp; nothing is dispatched (the tokens are the same on every tp rank) and the partial outputs
are summed over tp. With a 2-D (ep, tp) mesh, both: each ep group (ranks of one tp index) dispatches as above, and
the owner's experts, split over tp, sum their partial outputs over tp before the combine.

Gradients: an expert's gradient sums what every rank of its ep group sent it, while dense gradients are
averaged over the batch ranks; ``grad_scale`` (set to 1/ep by the composer) divides the sum, and FSDP,
which shards the experts over the ranks that hold the same ones, averages over those.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from lightning_nd.expert_parallel.communication import ScaleGrad, all_to_all_rows, exchange_counts, summed_counts
from lightning_nd.expert_parallel.lists import ListedExperts, apply_ep_to_lists
from lightning_nd.model.structure import is_experts
from lightning_nd.tensor_parallel.apply.experts import DOWN_PLACEMENT, GATE_UP_PLACEMENT, check_same_routing, tp_slice
from lightning_nd.tensor_parallel.communication import copy_to_tp, reduce_from_tp


class ExpertParallel(nn.Module):
    """This rank's experts of one layer, with the all-to-all dispatch and combine around them."""

    gate_up_proj: DTensor
    down_proj: DTensor

    def __init__(self, experts: nn.Module, mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None = None) -> None:
        """``mesh``: the 1-D ep mesh (None: every expert here), or the 2-D (ep, tp) mesh of experts split both ways;
        ``tp_mesh``: the 1-D tp mesh each expert is split over (`lightning_nd.tensor_parallel.apply.experts`; None: whole)."""
        super().__init__()
        if (mesh is None) == (tp_mesh is None) or mesh is not None and mesh.ndim not in (1, 2):
            raise ValueError("ExpertParallel takes a 1-D ep mesh, a 1-D tp mesh, or a 2-D (ep, tp) mesh.")
        self.group: dist.ProcessGroup | None = None
        self.tp_group: dist.ProcessGroup | None = tp_mesh.get_group() if tp_mesh is not None else None
        if mesh is not None and mesh.ndim == 2:
            self.group, self.tp_group = mesh.get_group(0), mesh.get_group(1)
        elif mesh is not None:
            self.group = mesh.get_group()
        size, rank = (dist.get_world_size(self.group), dist.get_rank(self.group)) if self.group else (1, 0)
        self.tp_size, self.tp_rank = (dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
                                      ) if self.tp_group else (1, 0)
        self.num_experts = cast(torch.Tensor, experts.gate_up_proj).shape[0]
        assert self.num_experts % size == 0, "the plan checks that ep divides every experts module"
        self.size, self.local = size, self.num_experts // size
        first = rank * self.local
        self.first = first
        # DTensors sharded over ep (or split over tp): checkpoints, clipping and `full_tensor()` see the whole stack.
        stack = [self._tp_slice(name, getattr(experts, name).detach()[first:first + self.local])
                 for name in ("gate_up_proj", "down_proj")]
        on = cast(DeviceMesh, tp_mesh if tp_mesh is not None else mesh)
        placements: list[list[Placement]] = ([[Shard(0)]] * 2 if self.tp_group is None else
                                             [[GATE_UP_PLACEMENT], [DOWN_PLACEMENT]] if self.group is None else
                                             [[Shard(0), GATE_UP_PLACEMENT], [Shard(0), DOWN_PLACEMENT]])
        for name, local, placement in zip(("gate_up_proj", "down_proj"), stack, placements):
            setattr(self, name, nn.Parameter(DTensor.from_local(local.clone(), on, placement, run_check=False),
                                             requires_grad=getattr(experts, name).requires_grad))
        self.capacity_factor: float | None = getattr(experts, "capacity_factor", None)
        self.act: Callable[[torch.Tensor], torch.Tensor] = getattr(experts, "act_fn", F.silu)
        self.last_counts: torch.Tensor | None = None
        self.last_dropped = 0
        self.grad_scale = 1.0

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Each local expert drawn from its own seed, derived from the caller's RNG state (which `materialize`
        seeds per ep shard), so every expert differs from the others."""
        base = int(torch.randint(2**31, ()))
        for name in ("gate_up_proj", "down_proj"):
            weight, whole = getattr(self, name).to_local(), getattr(self, name).shape[1:]
            bound = 1.0 / math.sqrt(whole[-1])
            for index in range(weight.shape[0]):  # this rank's experts (or its FSDP shard of their rows)
                generator = torch.Generator().manual_seed(base + self.first + index)
                values = torch.rand(whole, generator=generator, dtype=weight.dtype) * 2 * bound - bound
                weight[index].copy_(self._tp_slice(name, values).to(weight.device))
            base += self.num_experts

    def _tp_slice(self, name: str, expert: torch.Tensor) -> torch.Tensor:
        """This tp rank's slice of one whole expert's ``name`` weight (the weight itself without tp)."""
        return tp_slice(name, expert, self.tp_rank, self.tp_size) if self.tp_group is not None else expert

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        top_k = index.shape[1]
        flat = index.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.tp_group is not None:
            check_same_routing(counts, self.tp_group)
        if self.group is None:  # every expert here: nothing to dispatch
            self.last_counts = counts
            rows = hidden[order // top_k]
            output = self._experts(rows, counts.view(1, -1), index.shape[0], top_k)
            return self._combined(hidden, output, order, weights, top_k)
        # Per-expert counts from every sender: [sender, local expert]; and the global token count.
        received_counts = exchange_counts(counts.view(self.size, self.local), self.group)
        totals = summed_counts(counts, self.group)
        self.last_counts = totals
        send_splits = counts.view(self.size, self.local).sum(1).tolist()
        recv_splits = received_counts.sum(1).tolist()
        rows = all_to_all_rows(hidden[order // top_k], send_splits, recv_splits, self.group)
        output = self._experts(rows, received_counts, int(totals.sum()) // top_k, top_k)
        back = all_to_all_rows(output, recv_splits, send_splits, self.group)
        return self._combined(hidden, back, order, weights, top_k)

    @staticmethod
    def _combined(hidden: torch.Tensor, back: torch.Tensor, order: torch.Tensor, weights: torch.Tensor,
                  top_k: int) -> torch.Tensor:
        result = torch.zeros_like(hidden)
        result.index_add_(0, order // top_k, (back * weights.flatten()[order, None]).to(result.dtype))
        return result

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
        """``rows`` arrive grouped by sender, then by local expert; run each expert on its rows, senders in
        rank order, keeping at most the capacity (global) per expert; dropped rows give zeros."""
        starts = torch.cumsum(counts.flatten(), 0) - counts.flatten()
        capacity = math.ceil(self.capacity_factor * tokens * top_k / self.num_experts) if self.capacity_factor else None
        if capacity is not None:  # every owner drops what exceeds capacity: from the global counts, no collective
            assert self.last_counts is not None, "forward sets them before running the experts"
            self.last_dropped = int((self.last_counts - capacity).clamp_min(0).sum())
        if self.tp_group is not None:
            rows = copy_to_tp(rows, self.tp_group)
        output = torch.zeros_like(rows)
        gate_up_proj = ScaleGrad.apply(self.gate_up_proj.to_local(), self.grad_scale)
        down_proj = ScaleGrad.apply(self.down_proj.to_local(), self.grad_scale)
        counts_list, starts_list = counts.tolist(), starts.tolist()
        for expert in range(self.local):
            pieces = [torch.arange(starts_list[s * self.local + expert],
                                   starts_list[s * self.local + expert] + counts_list[s][expert], device=rows.device)
                      for s in range(self.size)]
            chosen = torch.cat(pieces)
            if capacity is not None:
                chosen = chosen[:capacity]
            # Even an expert without rows runs (on none): the output stays in the graph, so every rank's
            # backward issues the same all-to-alls (a rank whose experts got no tokens would hang the rest).
            gate, up = F.linear(rows[chosen], gate_up_proj[expert]).chunk(2, dim=-1)
            output = output.index_add(0, chosen, F.linear(self.act(gate) * up, down_proj[expert]))
        return reduce_from_tp(output, self.tp_group) if self.tp_group is not None else output


def apply_ep(model: nn.Module, mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None = None) -> list[str]:
    """Replace every experts module of ``model`` by this rank's `ExpertParallel` slice over ``mesh`` (1-D ep, or 2-D
    (ep, tp)), or split over the 1-D ``tp_mesh`` (expert tensor parallelism); and with ``mesh``, every list of experts
    by this rank's `ListedExperts` over ep (`lightning_nd.expert_parallel.lists`; tp splits them as it splits any
    MLP). Returns their names."""
    names = [name for name, module in model.named_modules() if name and is_experts(module)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        experts = getattr(parent, child)
        shard = ExpertParallel(experts, mesh, tp_mesh)
        # Still a kind of the module it replaces (as FSDP2's `FSDP<Class>` is), so a model's own init that picks
        # its experts by class (transformers' `_init_weights`: `isinstance(module, MixtralExperts)`) finds them when
        # a meta-device build replays it; ExpertParallel's own methods come first.
        shard.__class__ = _shard_class(type(experts))
        setattr(parent, child, shard)
    if mesh is not None:
        names += apply_ep_to_lists(model, mesh if mesh.ndim == 1 else mesh["ep"])
    return names


_SHARD_CLASSES: dict[type, type] = {}


def _shard_class(replaced: type) -> type:
    """One `ExpertParallel` subclass of each experts class, made on first use."""
    if replaced not in _SHARD_CLASSES:
        _SHARD_CLASSES[replaced] = type(f"ExpertParallel{replaced.__name__}", (ExpertParallel, replaced),
                                        {"__module__": __name__})
    return _SHARD_CLASSES[replaced]


def expert_modules(model: nn.Module) -> list[ExpertParallel | ListedExperts]:
    return [m for m in model.modules() if isinstance(m, (ExpertParallel, ListedExperts))]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in expert_modules(model) for p in m.parameters()]
