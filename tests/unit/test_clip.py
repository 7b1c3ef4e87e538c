"""`clip_grad_norm_` / `global_grad_norm` on plain tensors match `torch.nn.utils.clip_grad_norm_`."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from lightning_nd.runtime.clip import clip_grad_norm_, global_grad_norm


def _params_with_grads(scale: float, seed: int = 0) -> list[torch.nn.Parameter]:
    """A few shapes, one parameter without a gradient (it must be skipped, as torch does)."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((4, 3), (7,), (2, 2, 5), (3,))]
    for param in params[:-1]:
        param.grad = scale * torch.randn(param.shape, generator=generator)
    return params


def _clone(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    copies = []
    for param in params:
        copy = torch.nn.Parameter(param.detach().clone())
        copy.grad = None if param.grad is None else param.grad.clone()
        copies.append(copy)
    return copies


def _grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    return [param.grad for param in params]


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0])
def test_global_grad_norm_matches_torch(norm_type):
    params = _params_with_grads(scale=3.0)
    expected = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], norm_type)
    assert_close(global_grad_norm(params, norm_type), expected)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_matches_torch_when_the_norm_is_above_max(norm_type):
    params = _params_with_grads(scale=3.0)
    reference = _clone(params)
    max_norm = 0.5
    expected_norm = torch.nn.utils.clip_grad_norm_(reference, max_norm, norm_type)
    assert expected_norm > max_norm
    total = clip_grad_norm_(params, max_norm, norm_type)
    assert_close(total, expected_norm)
    for grad, expected in zip(_grads(params), _grads(reference)):
        assert (grad is None) == (expected is None)
        if grad is not None:
            assert_close(grad, expected)
    clipped = global_grad_norm(params, norm_type)
    assert_close(clipped, torch.tensor(max_norm), atol=1e-5, rtol=0)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_is_a_no_op_below_max(norm_type):
    params = _params_with_grads(scale=0.01)
    before = [g.clone() for g in _grads(params) if g is not None]
    max_norm = 10.0
    total = clip_grad_norm_(params, max_norm, norm_type)
    expected_norm = torch.nn.utils.clip_grad_norm_(_clone(params), max_norm, norm_type)
    assert total < max_norm
    assert_close(total, expected_norm)
    for grad, original in zip([g for g in _grads(params) if g is not None], before):
        assert torch.equal(grad, original)


def test_no_gradients_gives_a_zero_norm():
    params = [torch.nn.Parameter(torch.ones(3))]
    assert_close(clip_grad_norm_(params, 1.0), torch.nn.utils.clip_grad_norm_(_clone(params), 1.0))
