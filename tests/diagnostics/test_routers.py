"""Finding and counting routers in one process (diagnostics/collect/routers.py): the forms a router's choice takes
(indices, logits, a gate linear's output in an older block), what is not counted (evaluation, a checkpointed block's
recomputation, the pipeline's trial forward) and a router whose choice cannot be read said so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from diagnostics import RoutingMonitor, all_monitors
from diagnostics.collect.routers import attach, find_routers, whole_name
from lightning_nd.nn.moe import MoE
from lightning_nd.runtime.trial import trial_forward


class OldBlock(nn.Module):
    """An MoE block as transformers 4 wrote Mixtral's: a plain gate linear, the top-k taken in the block's forward,
    returning the router logits beside the output (or, with ``logits=False``, only the output)."""

    def __init__(self, hidden: int = 16, experts: int = 6, top_k: int = 2, logits: bool = True) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.logits = experts, top_k, logits
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))
        self.chosen: list[torch.Tensor] = []

    def forward(self, hidden: torch.Tensor):
        flat = hidden.reshape(-1, hidden.shape[-1])
        router_logits = self.gate(flat)
        weights, chosen = torch.topk(F.softmax(router_logits, dim=-1), self.top_k, dim=-1)
        self.chosen.append(chosen)
        out = sum(weights[:, i:i + 1] * torch.stack([self.experts[e](flat[t]) for t, e in enumerate(chosen[:, i])])
                  for i in range(self.top_k))
        return (out.reshape(hidden.shape), router_logits) if self.logits else out.reshape(hidden.shape)


class BiasedRouter(nn.Module):
    """A router whose choice is the top-k of its scores plus a correction bias, returning only weights [T, E]."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k, self.num_experts = 2, 4
        self.weight = nn.Parameter(torch.randn(4, 8))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(4))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        return (F.linear(hidden, self.weight).softmax(-1),)


def _truth(chosen: list[torch.Tensor], experts: int) -> list[int]:
    return torch.bincount(torch.cat(chosen).flatten(), minlength=experts).tolist()


def test_an_older_block_is_counted_from_its_router_logits_or_its_gate_linear():
    torch.manual_seed(0)
    model = nn.Sequential(OldBlock(logits=True), nn.Identity(), OldBlock(logits=False))
    routers = find_routers(model)
    assert [(r.name, r.experts, r.top_k) for r in routers] == [("0", 6, 2), ("2", 6, 2)]
    attach(routers)
    hidden = torch.randn(3, 5, 16)
    model[0](hidden)
    model[2](hidden)
    for router, block in zip(routers, (model[0], model[2])):
        counts, tokens, dropped = router.take()
        assert counts == _truth(block.chosen, 6) and tokens == 15 and router.unreadable is None
        assert not router.reports_dropped


def test_evaluation_recomputation_and_the_trial_forward_are_not_counted():
    torch.manual_seed(0)
    layer = MoE(16, 24, 8, top_k=2, capacity_factor=1.0)
    (router,) = find_routers(nn.ModuleDict({"mlp": layer}))
    assert router.name == "mlp.gate" and router.block is layer and router.reports_dropped
    attach([router])
    chosen: list[torch.Tensor] = []
    layer.gate.register_forward_hook(lambda m, a, out: chosen.append(out[2]))
    hidden = torch.randn(10, 16, requires_grad=True)
    checkpoint(layer, hidden, use_reentrant=False).sum().backward()  # forward, then its recomputation in backward
    assert len(chosen) == 2
    counts, tokens, dropped = router.take()
    assert counts == _truth(chosen[:1], 8) and tokens == 10 and dropped == layer.experts.last_dropped > 0
    with trial_forward():
        layer(hidden)
    layer.eval()
    layer(hidden)
    assert router.take() == ([0] * 8, 0, 0)


def test_a_router_with_a_correction_bias_and_no_indices_is_not_counted_and_says_why():
    model = nn.ModuleDict({"gate": BiasedRouter()})
    (router,) = find_routers(model)
    attach([router])
    model["gate"](torch.randn(5, 8))
    assert router.take()[1] == 0
    assert router.unreadable == "it returns no expert indices and does not select the plain top-k of its logits"


class StrayRouter(nn.Module):
    """A router choosing experts beyond the ones it scores (as LongCat's would, read with the wrong expert count)."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k, self.weight = 1, nn.Parameter(torch.randn(3, 8))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden, torch.full((hidden.shape[0], 1), 7)


def test_a_router_choosing_beyond_its_experts_is_left_out_without_stopping_the_run():
    model = nn.ModuleDict({"gate": StrayRouter()})
    (router,) = find_routers(model)
    attach([router])
    model["gate"](torch.randn(5, 8))
    model["gate"](torch.randn(5, 8))
    assert router.take() == ([0, 0, 0], 0, 0) and router.unreadable == "it chose expert 7 of the 3 it scores"


def test_a_transformers_model_is_no_router_though_it_keeps_expert_counts():
    from tests.hf_tiny import tiny_model

    model = tiny_model("doge")  # its tiny config has no MoE layer; the model keeps num_experts_per_tok
    assert hasattr(model, "num_experts_per_tok") and find_routers(model) == []


def test_llama4s_router_is_counted_from_its_scores():
    from tests.hf_tiny import tiny_model

    torch.manual_seed(0)
    model = tiny_model("llama4_text").train()
    routers = find_routers(model)
    assert routers and all(type(r.module).__name__ == "Llama4Router" for r in routers)
    attach(routers)
    chosen: dict[str, torch.Tensor] = {}
    for router in routers:  # its scores are 0 except for the chosen experts
        router.module.register_forward_hook(lambda m, a, out, n=router.name: chosen.__setitem__(n, out[0] > 0))
    model(input_ids=torch.randint(3, 100, (2, 8)))
    for router in routers:
        counts, tokens, _ = router.take()
        assert counts == chosen[router.name].sum(0).tolist() and tokens == 16


@pytest.mark.parametrize("key", ["mixtral", "shared_grouped_moe"])
def test_litgpts_blocks_are_counted_through_their_configs_top_k(key):
    # `LLaMAMoE` takes the top-k of its gate linear's logits; `GroupedTopkRouter` returns its indices
    pytest.importorskip("litgpt")
    from tests.distributed.litgpt_models import build_litgpt

    model = build_litgpt(key).train()
    routers = find_routers(model)
    grouped = key == "shared_grouped_moe"
    assert [(r.name, r.experts, r.top_k) for r in routers] == [
        (f"transformer.h.{i}.mlp{'.gate' if grouped else ''}", 4, 2) for i in range(1 if grouped else 0, 4)]
    attach(routers)
    chosen: dict[str, torch.Tensor] = {}
    for router in routers:
        gate = router.module if grouped else router.module.gate
        gate.register_forward_hook(lambda m, a, out, n=router.name: chosen.__setitem__(
            n, out[1] if grouped else out.topk(2, dim=-1).indices))
    model(torch.randint(0, 100, (2, 8)))
    for router in routers:
        assert router.take() == (_truth([chosen[router.name]], 4), 16, 0) and router.unreadable is None


def test_names_are_the_whole_models():
    assert whole_name("model.stages.1.module.layers.3._checkpoint_wrapped_module.mlp.gate", "model") == (
        "model.layers.3.mlp.gate")
    assert whole_name("model._orig_mod.layers.0.mlp.gate", None) == "model.layers.0.mlp.gate"
    assert whole_name("stages.0.module.layers.1.mlp.router", "") == "stages.0.module.layers.1.mlp.router"


def test_bad_arguments_are_refused_with_the_fix():
    for every in (0, 2.5, True):
        with pytest.raises(ValueError, match="must be an int >= 1. HINT: 50"):
            RoutingMonitor(every_n_steps=every)
    assert "RoutingMonitor" not in [type(m).__name__ for m in all_monitors(routing=False)]
    (monitor,) = [m for m in all_monitors(routing={"every_n_steps": 7}) if type(m).__name__ == "RoutingMonitor"]
    assert monitor.every == 7
