"""The reference MoE block on one process: routing, grouped experts, capacity, losses, balancing."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_nd.nn.moe import MoE, moe_aux_loss


def _naive(moe: MoE, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, keep=None) -> torch.Tensor:
    """Token by token: the weighted sum of its chosen experts' SwiGLU outputs."""
    experts = moe.experts
    out = torch.zeros_like(hidden)
    for token in range(hidden.shape[0]):
        for slot in range(index.shape[1]):
            if keep is not None and not keep[token, slot]:
                continue
            e = int(index[token, slot])
            gate, up = F.linear(hidden[token], experts.gate_up_proj[e]).chunk(2)
            out[token] += weights[token, slot] * F.linear(F.silu(gate) * up, experts.down_proj[e])
    return out


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared", [None, 24])
def test_moe_equals_the_token_by_token_computation(score_func, shared):
    torch.manual_seed(0)
    moe = MoE(16, 32, num_experts=4, top_k=2, score_func=score_func, shared_intermediate=shared).double()
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    out = moe(x)
    hidden = x.reshape(-1, 16)
    logits, weights, index = moe.gate(hidden)
    expected = _naive(moe, hidden, index, weights) + (moe.shared_expert(hidden) if shared else 0)
    torch.testing.assert_close(out.reshape(-1, 16), expected, rtol=1e-12, atol=1e-12)
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    torch.testing.assert_close(weights, scores.gather(-1, index) / scores.gather(-1, index).sum(-1, keepdim=True))
    assert moe.stats.tokens_per_expert.sum() == 15 * 2 and moe.stats.dropped == 0
    (out.square().sum() + moe_aux_loss(moe)).backward()
    assert moe.gate.weight.grad.abs().sum() > 0 and moe.experts.down_proj.grad.abs().sum() > 0


def test_capacity_drops_the_latest_tokens_of_an_overloaded_expert():
    torch.manual_seed(0)
    moe = MoE(8, 16, num_experts=4, top_k=1, capacity_factor=1.0).double()
    with torch.no_grad():
        moe.gate.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # every token picks expert 0
    x = torch.randn(8, 8, dtype=torch.float64)
    out = moe(x)
    capacity = math.ceil(1.0 * 8 * 1 / 4)
    _, weights, index = moe.gate(x)
    keep = torch.arange(8)[:, None] < capacity  # expert 0 keeps the first `capacity` tokens in token order
    assert (index == 0).all() and moe.stats.dropped == 8 - capacity
    torch.testing.assert_close(out, _naive(moe, x, index, weights, keep), rtol=1e-12, atol=1e-12)
    assert out[capacity:].abs().sum() == 0


def test_load_balancing_and_z_losses_follow_their_formulas():
    torch.manual_seed(0)
    moe = MoE(8, 16, num_experts=4, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001)
    x = torch.randn(10, 8)
    moe(x)
    logits, _, index = moe.gate(x)
    fraction = torch.bincount(index.flatten(), minlength=4).float() / index.numel()
    balance = 4 * (fraction * logits.softmax(-1).mean(0)).sum()
    z_loss = torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(moe.aux_loss, 0.01 * balance + 0.001 * z_loss)
    assert moe.stats.load_balance_loss == pytest.approx(balance.item()) and moe.stats.z_loss == pytest.approx(z_loss.item())


def test_bias_update_moves_load_toward_the_mean():
    torch.manual_seed(0)
    moe = MoE(8, 16, num_experts=4, top_k=1, bias_update_rate=0.1)
    with torch.no_grad():
        moe.gate.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))
    moe(torch.randn(16, 8))
    moe.update_bias()
    torch.testing.assert_close(moe.gate.expert_bias, torch.tensor([9.9, 0.1, 0.1, 0.1]))
    assert moe.load.sum() == 0


def test_random_routing_anneals_to_learned_routing():
    torch.manual_seed(0)
    moe = MoE(8, 16, num_experts=8, top_k=2, random_routing_steps=4)
    x = torch.randn(256, 8)
    learned = moe.gate(x)[2]
    routed = []
    moe.gate.register_forward_hook(lambda module, args, output: routed.append(output[2]))
    for _ in range(5):  # steps 0..4: a share of 1, 3/4, 1/2, 1/4, 0 of the tokens goes to random experts
        moe(x)
    rerouted = [float((index != learned).any(-1).float().mean()) for index in routed]
    assert moe.step == 5
    assert rerouted[0] > 0.8 and 0.3 < rerouted[2] < 0.7 and rerouted[4] == 0.0, rerouted


def test_top_k_above_the_expert_count_names_the_fix():
    with pytest.raises(ValueError, match="top_k=5.*num_experts=4.*HINT"):
        MoE(8, 16, num_experts=4, top_k=5)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")
def test_the_examples_step_trains_with_the_moe_layers_auxiliary_losses():
    """`examples.lit.CausalLM` adds its MoE layers' load-balancing and z losses (issue 24, symptom 6): its step's
    loss is the next-token loss plus `moe_aux_loss`, which the strategy adds itself under pp."""
    from examples.data import SyntheticTokens
    from examples.lit import CausalLM
    from tests.models import build

    module = CausalLM(model=build("moe_llama"))
    batch = {key: torch.stack([SyntheticTokens(256, 16, 4)[i][key] for i in range(4)]) for key in ("tokens", "labels")}
    step = module.training_step(batch, 0)
    aux = moe_aux_loss(module.model)
    assert isinstance(aux, torch.Tensor) and aux.item() > 0
    torch.testing.assert_close(step, module.loss(batch) + aux, rtol=0, atol=0)
