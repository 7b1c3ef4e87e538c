"""A build that runs modules' ``reset_parameters()`` from outside the model (LitGPT's ``utils.reset_parameters``, its
pretraining init) is what materialising does anyway: a ``reset_parameters`` set on a module object is what
materialising runs for that module, and a buffer a module's own ``reset_parameters()`` assigns anew (LitGPT's rope
cache) is not refused (lightning_nd/runtime/init_record.py)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from lightning_nd.runtime.probe import check_initialisable
from tests.unit.test_materialize import materialized, on_meta


def _pretraining_init(module: nn.Module, std: float) -> None:
    nn.init.normal_(module.weight, mean=0.0, std=std)
    if getattr(module, "bias", None) is not None:
        nn.init.zeros_(module.bias)


def reset_all(model: nn.Module) -> None:
    """LitGPT's ``utils.reset_parameters``: every module's ``reset_parameters()``, from outside any module."""
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()


def litgpt_pretraining_style(call_them: bool = True) -> nn.Module:
    """LitGPT's pretraining init: each module object given a ``reset_parameters`` of its own (a `partial`), then all
    run by a function outside the model."""
    model = nn.Sequential(nn.Embedding(300, 16), nn.Linear(16, 300))
    for module in model:
        module.reset_parameters = partial(_pretraining_init, module, std=0.5)
    if call_them:
        reset_all(model)
    return model


@pytest.mark.parametrize("call_them", [True, False])
def test_a_reset_parameters_set_on_the_module_object_is_what_materialising_runs(call_them):
    model = materialized(lambda: litgpt_pretraining_style(call_them))
    assert abs(float(model[0].weight.std()) - 0.5) < 0.05 and abs(float(model[1].weight.std()) - 0.5) < 0.05
    assert model[1].bias.abs().max() == 0


def test_a_write_outside_the_module_objects_own_reset_is_still_refused():
    def build() -> nn.Module:
        model = litgpt_pretraining_style()
        nn.init.normal_(model[1].weight, std=0.1)
        return model

    holder, init = on_meta(build)
    with pytest.raises(ValueError, match="`model.1.weight`"):
        check_initialisable(holder, init)



class RopeCache(nn.Module):
    """A buffer its own ``reset_parameters()`` assigns anew, as LitGPT's ``GPT`` does with ``cos`` / ``sin``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos", torch.arange(4.0).cos(), persistent=False)

    def reset_parameters(self) -> None:
        self.cos = torch.arange(4.0, device=self.cos.device).cos()


def test_a_buffer_its_own_reset_assigns_anew_from_a_walk_outside_the_model():
    def build() -> nn.Module:
        model = nn.Sequential(RopeCache(), nn.Linear(4, 4))
        reset_all(model)
        return model

    holder, init = on_meta(build)
    check_initialisable(holder, init)
    torch.testing.assert_close(materialized(build)[0].cos, torch.arange(4.0).cos())
