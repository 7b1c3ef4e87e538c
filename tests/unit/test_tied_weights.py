"""A weight tied between the first and the last pipeline stage, on one process: a V-shaped schedule's rank
holds both stages, so its copies are summed and kept equal locally; the gradient norm counts the weight once."""

from __future__ import annotations

import torch

from lightning_nd.layout.record import StagePlan
from lightning_nd.model.structure import find_blocks
from lightning_nd.pipeline_parallel.split import split_stages, stage_ranks
from lightning_nd.pipeline_parallel.stage import StageModule
from lightning_nd.pipeline_parallel.tied import TiedWeights
from lightning_nd.runtime.clip import clip_grad_norm_, global_grad_norm
from tests.models import build


def _rank0_of_a_v_schedule() -> tuple[StageModule, StageModule, TiedWeights]:
    model = build("gpt4")
    split = split_stages(model, find_blocks(model), 4)
    first, last = StageModule(model, split, 0), StageModule(model, split, 3)
    with torch.no_grad():
        last.module.out.weight.add_(1.0)  # as if materialised apart: the copies must be made equal
    tied = TiedWeights([first, last], StagePlan("model", split, stage_ranks(2, 2, "zbv")), mesh=None)
    return first, last, tied


def test_a_rank_holding_both_stages_makes_its_copies_equal_and_sums_their_gradients():
    first, last, tied = _rank0_of_a_v_schedule()
    weight, copy = first.module.tok.weight, last.module.out.weight
    assert tied.group is None and copy is not weight
    torch.testing.assert_close(copy, weight, rtol=0, atol=0)
    weight.grad, copy.grad = torch.full_like(weight, 1.0), torch.full_like(copy, 2.0)
    tied.sum_grads()
    torch.testing.assert_close(weight.grad, torch.full_like(weight, 3.0), rtol=0, atol=0)
    torch.testing.assert_close(copy.grad, weight.grad, rtol=0, atol=0)


def test_the_gradient_norm_counts_a_tied_weight_once_and_clipping_scales_both_copies_alike():
    first, last, _ = _rank0_of_a_v_schedule()
    weight, copy = first.module.tok.weight, last.module.out.weight
    other = first.module.pos.weight
    for param, value in ((weight, 3.0), (copy, 3.0), (other, 4.0)):
        param.grad = torch.zeros_like(param)
        param.grad.view(-1)[0] = value
    torch.testing.assert_close(global_grad_norm([weight, copy, other]), torch.tensor(5.0))
    clip_grad_norm_([weight, copy, other], max_norm=1.0)
    torch.testing.assert_close(copy.grad, weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(weight.grad.view(-1)[0], torch.tensor(0.6), rtol=1e-5, atol=1e-6)
