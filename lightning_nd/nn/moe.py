"""A reference mixture-of-experts block that parallelizes cleanly (experts stacked, one dispatch point).

`MoE` = `TopKRouter` + `GroupedExperts` (+ an optional dense shared expert). It follows the Hugging Face
experts convention, so expert parallelism can treat both alike: the router returns ``(logits, weights,
index)``; the experts hold stacked ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] weights and are
called as ``experts(hidden [T, H], index [T, k], weights [T, k])``.

Routing: softmax or sigmoid scores, top-k (weights renormalised over the chosen k unless
``norm_topk=False``); an expert bias that only steers selection, updated by the sign of each expert's
load error (aux-loss-free balancing, `MoE.update_bias`, before the optimizer step); optional random
routing for the first ``random_routing_steps`` training steps, annealed linearly to learned routing.
Capacity: with ``capacity_factor`` each expert takes at most ceil(factor x T x k / E) assignments, in
token order, and drops the rest (their share of the output is zero); ``None`` is dropless.
Losses (`MoE.aux_loss`, added to the training loss by the user, see `moe_aux_loss`): the Switch/GShard
load-balancing loss ``coef * E * sum_e f_e * P_e`` and the router z-loss ``coef * mean(logsumexp^2)``.
`MoE.stats` holds the last forward's tokens per expert, dropped assignments and both losses.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed
import torch.nn.functional as F
from torch import nn

from lightning_nd.runtime.trial import in_trial_forward


@dataclass
class MoEStats:
    tokens_per_expert: torch.Tensor
    dropped: int
    load_balance_loss: float
    z_loss: float


class TopKRouter(nn.Module):
    expert_bias: torch.Tensor

    def __init__(self, hidden: int, num_experts: int, top_k: int, score_func: Literal["softmax", "sigmoid"] = "softmax",
                 norm_topk: bool = True) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}. HINT: top_k=2 is common.")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func={score_func!r} is not 'softmax' or 'sigmoid'.")
        self.num_experts, self.top_k, self.score_func, self.norm_topk = num_experts, top_k, score_func, norm_topk
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        nn.init.zeros_(self.expert_bias)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()

    def forward(self, hidden: torch.Tensor, random_share: float = 0.0,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden`` [T, H] -> (logits [T, E] in fp32 or wider, weights [T, k], index [T, k]).

        ``random_share``: the probability that a token is routed to k random experts instead."""
        logits = F.linear(hidden, self.weight).to(torch.promote_types(hidden.dtype, torch.float32))
        scores = self.scores(logits)
        index = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
        if random_share > 0:
            noise = torch.rand(scores.shape, generator=generator, device=scores.device)
            random_index = noise.topk(self.top_k, dim=-1).indices
            use = torch.rand(scores.shape[0], 1, generator=generator, device=scores.device) < random_share
            index = torch.where(use, random_index, index)
        weights = scores.gather(-1, index)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(hidden.dtype), index


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts with stacked weights; tokens grouped by expert, one matmul pair each."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, capacity_factor: float | None = None) -> None:
        super().__init__()
        self.num_experts, self.capacity_factor = num_experts, capacity_factor
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.reset_parameters()
        self.last_counts: torch.Tensor | None = None
        self.last_dropped = 0

    def reset_parameters(self) -> None:
        for weight in (self.gate_up_proj, self.down_proj):
            bound = 1.0 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = index.shape
        flat = index.flatten()
        order = torch.argsort(flat, stable=True)  # grouped by expert, token order kept inside a group
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.last_counts = counts.detach()
        keep = torch.ones_like(order, dtype=torch.bool)
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * tokens * top_k / self.num_experts)
            starts = torch.cumsum(counts, 0) - counts
            rank_in_expert = torch.arange(order.numel(), device=order.device) - starts.repeat_interleave(counts)
            keep = rank_in_expert < capacity
        self.last_dropped = int((~keep).sum())
        output = torch.zeros_like(hidden)
        offsets = [0, *torch.cumsum(counts, 0).tolist()]
        for expert in range(self.num_experts):
            rows = slice(offsets[expert], offsets[expert + 1])
            kept = keep[rows]
            if not bool(kept.any()):
                continue
            chosen = order[rows][kept]  # flat (token, slot) positions, token = position // top_k
            gate, up = F.linear(hidden[chosen // top_k], self.gate_up_proj[expert]).chunk(2, dim=-1)
            expert_out = F.linear(F.silu(gate) * up, self.down_proj[expert])
            output.index_add_(0, chosen // top_k, expert_out * weights.flatten()[chosen, None])
        return output


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    step: torch.Tensor
    load: torch.Tensor

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int = 2,
        *,
        score_func: Literal["softmax", "sigmoid"] = "softmax",
        norm_topk: bool = True,
        shared_intermediate: int | None = None,
        capacity_factor: float | None = None,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.0,
        bias_update_rate: float = 0.0,
        random_routing_steps: int = 0,
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden, num_experts, top_k, score_func, norm_topk)
        self.experts = GroupedExperts(num_experts, hidden, intermediate, capacity_factor)
        self.shared_expert = SwiGLU(hidden, shared_intermediate) if shared_intermediate else None
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.bias_update_rate, self.random_routing_steps = bias_update_rate, random_routing_steps
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.register_buffer("load", torch.zeros(num_experts))
        self.aux_loss: torch.Tensor | None = None
        self.stats: MoEStats | None = None

    def reset_parameters(self) -> None:
        self.step.zero_()
        self.load.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.reshape(-1, x.shape[-1])
        # Activation checkpointing runs forward again inside backward: the same step (and, with the RNG
        # state checkpointing restores, the same random routing), and nothing counted twice; nor is the
        # pipeline's trial forward counted (its shape inference).
        recomputing = torch._C._current_graph_task_id() != -1
        step = int(self.step) - (1 if recomputing else 0)
        share = 0.0
        if self.training and step < self.random_routing_steps:
            share = 1.0 - step / self.random_routing_steps
        logits, weights, index = self.gate(hidden, share)
        out = self.experts(hidden, index, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(hidden)
        self._account(logits, count=not recomputing and not in_trial_forward())
        return out.reshape(x.shape)

    def _account(self, logits: torch.Tensor, count: bool) -> None:
        """The auxiliary losses (recomputation rebuilds them the same way); with ``count``, stats, step, load."""
        experts, counts = self.gate.num_experts, self.experts.last_counts
        assert counts is not None, "the experts ran in this forward"
        fraction = counts.float() / counts.sum()  # global under expert parallelism (see expert_parallel/dispatch.py)
        mean_score = self.gate.scores(logits).mean(dim=0)
        balance = experts * (fraction * mean_score).sum()
        z_loss = torch.logsumexp(logits, dim=-1).square().mean()
        aux_loss = self.aux_loss_coef * balance + self.z_loss_coef * z_loss
        if not count:
            return
        self.aux_loss = aux_loss
        self.stats = MoEStats(counts, self.experts.last_dropped, float(balance.detach()), float(z_loss.detach()))
        if self.training:  # `step` counts training forwards (micro-batches), which random routing anneals over
            self.step += 1
            self.load += counts.to(self.load.dtype)

    @torch.no_grad()
    def update_bias(self, group: torch.distributed.ProcessGroup | None = None) -> None:
        """Aux-loss-free balancing: raise the bias of experts below the mean load, lower it above; reset the load.

        Under data parallelism pass the batch ranks' group (``trainer.strategy.device_mesh.group("loss")``):
        the loads are summed over it first, so every replica moves its bias the same way."""
        if group is not None:
            torch.distributed.all_reduce(self.load, group=group)
        if self.bias_update_rate:
            self.gate.expert_bias += self.bias_update_rate * torch.sign(self.load.mean() - self.load)
        self.load.zero_()


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


_ADDED_BY_PIPELINE: ContextVar[list[bool] | None] = ContextVar("moe_aux_added_by_pipeline", default=None)


@contextmanager
def aux_losses_added_by_pipeline() -> Iterator[list[bool]]:
    """Inside a pipelined step every stage adds its layers' auxiliary losses itself
    (`lightning_nd/pipeline_parallel/aux_losses.py`): `moe_aux_loss` returns 0.0 and notes that it was asked."""
    asked: list[bool] = []
    token = _ADDED_BY_PIPELINE.set(asked)
    try:
        yield asked
    finally:
        _ADDED_BY_PIPELINE.reset(token)


def moe_aux_loss(module: nn.Module) -> torch.Tensor | float:
    """The sum of every MoE layer's auxiliary losses from the last forward: add it to the training loss.
    Under pipeline parallelism 0.0 inside the step: each stage adds its own layers' losses."""
    asked = _ADDED_BY_PIPELINE.get()
    if asked is not None:
        asked.append(True)
        return 0.0
    losses = [layer.aux_loss for layer in moe_layers(module) if layer.aux_loss is not None]
    return torch.stack(losses).sum() if losses else 0.0
