"""A weight tied between the first and the last pipeline stage (input and output embeddings).

The split (`pipeline_parallel/split.py`) gives each of the two stages its own copy. The copies start equal
(the first stage's is sent to the last after materialising), their gradients are summed once per optimizer
step, before clipping, and, given equal gradients and optimizer state, they take the same steps. This is
Megatron-LM's "embedding group" (`_allreduce_word_embedding_grads` in
megatron/core/distributed/finalize_model_grads.py): for each coordinate of the other dims, the pp rank
holding stage 0 and the one holding the last stage. Under a V-shaped schedule one rank holds both stages:
the sum is local. FSDP shards both copies alike (same shape, same ``fsdp`` mesh coordinate on both ranks),
so summing the local gradient shards sums the whole gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_nd.mesh.build import NDMesh
from lightning_nd.pipeline_parallel.split import StagePlan
from lightning_nd.pipeline_parallel.stage import StageModule
from lightning_nd.runtime.clip import PIPELINE_COPY
from lightning_nd.runtime.profiling import comm_label


class TiedWeights:
    """This rank's copies of the plan's tied weights and the group joining the two stages that hold them.

    Created on every rank at setup, after materialising (it makes process groups, in the same order on all
    ranks, and sends the first stage's values to the last stage's copy)."""

    def __init__(self, stages: Sequence[StageModule], plan: StagePlan, mesh: NDMesh) -> None:
        self.pairs: list[tuple[nn.Parameter | None, nn.Parameter | None]] = []
        by_index = {stage.index: stage for stage in stages}
        first, last = by_index.get(0), by_index.get(plan.num_stages - 1)
        for first_name, last_name in plan.split.tied:
            copy = last.module.get_parameter(last_name) if last is not None else None
            if copy is not None:
                setattr(copy, PIPELINE_COPY, first_name)  # the gradient norm counts the weight once
            self.pairs.append((first.module.get_parameter(first_name) if first is not None else None, copy))
        owner = {index: rank for rank, indices in enumerate(plan.ranks) for index in indices}
        self.group, self._src = None, None
        if plan.split.tied and owner[0] != owner[plan.num_stages - 1]:
            self.group, self._src = _pair_group(mesh, owner[0], owner[plan.num_stages - 1])
        self.copy_weights()

    @torch.no_grad()
    def copy_weights(self) -> None:
        """The last stage's copy takes the first stage's values."""
        for first, last in self.pairs:
            if first is not None and last is not None:
                _local(last).copy_(_local(first))
            elif self.group is not None and (held := first if first is not None else last) is not None:
                dist.broadcast(_local(held), src=self._src, group=self.group)

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Both copies' gradient becomes the sum of the two: once per optimizer step, after the last backward
        of the step (with gradient accumulation, the last micro-batch's) and before clipping."""
        for first, last in self.pairs:
            if first is not None and last is not None:
                first_grad, last_grad = _grad(first), _grad(last)
                _local(first_grad).add_(_local(last_grad))
                _local(last_grad).copy_(_local(first_grad))
            elif self.group is not None and (held := first if first is not None else last) is not None:
                with comm_label("pp", "tied_all_reduce"):
                    dist.all_reduce(_local(_grad(held)), group=self.group)

    def after(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (Lightning's training step and backward), then `sum_grads`."""

        def run() -> Any:
            result = closure()
            self.sum_grads()
            return result

        return run


def _pair_group(mesh: NDMesh, first_rank: int, last_rank: int) -> tuple[dist.ProcessGroup | None, int]:
    """The group of this rank's two pp ranks holding the first and the last stage (None when this rank holds
    neither), and the global rank of the first's; with pp=2 that is the pp group itself."""
    ranks = mesh.world.mesh.reshape(mesh.world.mesh.shape[0], -1)
    pairs = [[int(ranks[first_rank, j]), int(ranks[last_rank, j])] for j in range(ranks.shape[1])]
    me = dist.get_rank()
    mine = next((pair for pair in pairs if me in pair), None)
    if ranks.shape[0] == 2:
        group = mesh.group("pp")
    else:
        group, _ = dist.new_subgroups_by_enumeration(pairs)
    return (group if mine is not None else None), (mine[0] if mine is not None else -1)


def _grad(param: nn.Parameter) -> torch.Tensor:
    """The parameter's gradient; zeros when backward gave it none (the collective still needs this rank)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
