"""A tensor a model's construction makes as a constant (``torch.zeros`` / ``ones`` / ``full``, then only whole
``fill_`` / ``zero_``) keeps its value when the model is built on the meta device and materialised, also in a module
with no ``reset_parameters()`` and in one whose ``reset_parameters()`` does not touch it; anything else written to
such a tensor is still refused (lightning_nd/runtime/init_constants.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_nd.runtime.probe import check_initialisable
from tests.unit.test_materialize import materialized, on_meta


class Constants(nn.Module):
    """No ``reset_parameters()``: every tensor a constant, made each way torch offers."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))
        self.shift = nn.Parameter(torch.full((6,), 0.25))
        self.register_buffer("counts", torch.zeros(4, dtype=torch.long))
        self.register_buffer("mask", torch.ones(3, 3, dtype=torch.bool))
        self.register_buffer("like", torch.zeros_like(self.scale).fill_(-2.0))
        self.register_buffer("newer", self.scale.new_full((2,), 3))
        self.register_buffer("cleared", torch.full((5,), 9.0).zero_())


class ResetsOnlyItsWeight(nn.Linear):
    """``reset_parameters()`` initialises the weight and bias; the constructor also made a buffer of 7s."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.register_buffer("steps", torch.empty(3).fill_(7))


class Router(nn.Module):
    """LitGPT's ``GroupedTopkRouter`` shape: a weight the model's own ``_init_weights`` draws, a zero bias buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 8))
        self.register_buffer("e_score_correction_bias", torch.zeros(4))


class WithRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, Router):
            nn.init.normal_(module.weight, std=0.02)


def test_constants_made_each_way_keep_their_values():
    torch.manual_seed(0)
    plain, model = Constants(), materialized(Constants)
    for (name, got), (_, expected) in zip(model.state_dict().items(), plain.state_dict().items()):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        assert got.dtype == expected.dtype, name


def test_a_constant_buffer_beside_a_reset_parameters_keeps_its_value():
    model = materialized(ResetsOnlyItsWeight)
    assert model.steps.tolist() == [7.0, 7.0, 7.0]
    assert model.weight.std() > 0


def test_a_router_with_a_drawn_weight_and_a_zero_buffer_starts_like_plain_construction():
    model = materialized(WithRouter)
    assert model.router.e_score_correction_bias.tolist() == [0.0] * 4
    assert 0.01 < float(model.router.weight.std()) < 0.03


class DrawnInItsConstructor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))
        nn.init.normal_(self.weight)


class PartlyFilled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(4))
        self.table[:2].fill_(1.0)


@pytest.mark.parametrize("build", [DrawnInItsConstructor, PartlyFilled])
def test_a_constant_written_otherwise_is_still_refused(build):
    holder, init = on_meta(build)
    with pytest.raises(ValueError, match=f"{build.__name__} cannot be initialised there"):
        check_initialisable(holder, init)

