"""Run on each of 2 ranks: ``nn.MultiheadAttention`` split by heads (the ``multihead_attention`` style) against the
same module whole, for each way torch's module can be built and called (tests/distributed/test_tp_attention.py)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

BATCH, LENGTH, WIDTH, HEADS = 2, 6, 16, 4
CASES = {
    "self_causal_no_weights": ({}, {"self": True, "causal_mask": True, "need_weights": False, "is_causal": True}),
    "self_averaged_weights": ({}, {"self": True, "need_weights": True}),
    "per_head_weights_3d_bool_mask": ({}, {"self": True, "mask_3d": True, "need_weights": True,
                                           "average_attn_weights": False}),
    "cross_key_padding": ({}, {"self": False, "padding": True, "need_weights": False}),
    "seq_first_kdim_vdim": ({"batch_first": False, "kdim": 12, "vdim": 10}, {"self": False, "need_weights": False}),
    "bias_kv_zero_attn": ({"add_bias_kv": True, "add_zero_attn": True}, {"self": True, "need_weights": False}),
    "no_bias": ({"bias": False}, {"self": True, "need_weights": False}),
    "sequence_sharded_input": ({}, {"self": True, "need_weights": False, "sequence_sharded": True}),
}
"""name -> (module arguments, call): each compared for the output, the input and parameter gradients."""


def _inputs(built: dict, call: dict, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    first = built.get("batch_first", True)
    shape = lambda width: (BATCH, LENGTH, width) if first else (LENGTH, BATCH, width)  # noqa: E731
    query = torch.randn(shape(WIDTH), generator=generator)
    if call["self"]:
        return query, query, query
    return (query, torch.randn(shape(built.get("kdim", WIDTH)), generator=generator),
            torch.randn(shape(built.get("vdim", WIDTH)), generator=generator))


def _call_arguments(call: dict, generator: torch.Generator) -> dict:
    arguments = {"need_weights": call["need_weights"]}
    if "average_attn_weights" in call:
        arguments["average_attn_weights"] = call["average_attn_weights"]
    if call.get("causal_mask"):
        arguments["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(LENGTH)
        arguments["is_causal"] = call["is_causal"]
    if call.get("mask_3d"):
        arguments["attn_mask"] = torch.rand(BATCH * HEADS, LENGTH, LENGTH, generator=generator) > 0.7
        arguments["attn_mask"][..., 0] = False  # every query attends to something
    if call.get("padding"):
        arguments["key_padding_mask"] = torch.zeros(BATCH, LENGTH, dtype=torch.bool)
        arguments["key_padding_mask"][0, -2:] = True
    return arguments


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: (param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad).clone()
            for name, param in module.named_parameters()}


def compare() -> dict[str, dict[str, float]]:
    """For each case: the largest absolute difference of output, weights, input gradients and parameter gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_nd.tensor_parallel.apply.styles import style_for

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for name, (built, call) in CASES.items():
        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(1)
        whole = nn.MultiheadAttention(WIDTH, HEADS, **{"batch_first": True, **built})
        split = copy.deepcopy(whole)
        parallelize_module(split, mesh, style_for("multihead_attention", False, False))
        out_style = style_for("rowwise", call.get("sequence_sharded", False), False)
        parallelize_module(split.out_proj, mesh, out_style)
        inputs = _inputs(built, call, generator)
        arguments = _call_arguments(call, generator)
        leaves = [x.clone().requires_grad_() for x in dict.fromkeys(inputs)]
        by_id = {id(x): leaf for x, leaf in zip(dict.fromkeys(inputs), leaves)}
        expected, expected_weights = whole(*(by_id[id(x)] for x in inputs), **arguments)
        (expected.square().sum() + (expected_weights.sum() if expected_weights is not None else 0)).backward()
        split_leaves = [x.clone().requires_grad_() for x in dict.fromkeys(inputs)]
        split_by_id = {id(x): leaf for x, leaf in zip(dict.fromkeys(inputs), split_leaves)}
        given = [split_by_id[id(x)] for x in inputs]
        if call.get("sequence_sharded"):
            sharded = DTensor.from_local(given[0], mesh, [Replicate()], run_check=False).redistribute(
                placements=[Shard(1)])
            given = [sharded] * 3
        output, weights = split(*given, **arguments)
        output = output.full_tensor() if isinstance(output, DTensor) else output
        (output.square().sum() + (weights.sum() if weights is not None else 0)).backward()
        differences = {"output": (output - expected).abs().max().item(),
                       "input_grads": max((a.grad - b.grad).abs().max().item() for a, b in zip(split_leaves, leaves))}
        if expected_weights is not None:
            differences["weights"] = (weights - expected_weights).abs().max().item()
        reference = _grads(whole)
        differences["param_grads"] = max((g - reference[n]).abs().max().item() for n, g in _grads(split).items())
        differences["split"] = float(isinstance(split.out_proj.weight, DTensor) and isinstance(
            next(p for n, p in split.named_parameters() if "proj_weight" in n), DTensor))
        results[name] = differences
    results["lightning_demo_transformer"] = _demo_transformer(mesh)
    results["whole_child_with_gradient"] = _whole_child_with_gradient(mesh)
    results["per_feature_scales"] = _per_feature_scales(mesh)
    dist.destroy_process_group()
    return results


def _demo_transformer(mesh) -> dict[str, float]:
    """Lightning's demo `Transformer` (`nn.Transformer`: encoder, decoder, cross-attention), planned with no plan of
    ours at tp=2, against the same model whole in float64: largest differences of output and gradients."""
    from lightning.pytorch.demos import Transformer

    from lightning_nd import ParallelConfig, ParallelDims, plan_layout
    from lightning_nd.tensor_parallel.apply.model import apply_tp

    torch.manual_seed(0)
    model = Transformer(vocab_size=64, ninp=32, nhead=4, nhid=64, nlayers=2, dropout=0.0).double()
    whole = copy.deepcopy(model)
    source, target = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    expected = whole(source, target)
    expected.square().mean().backward()
    layout = plan_layout(model, ParallelDims(tp=2, world_size=2), ParallelConfig())
    apply_tp(model, mesh, {entry.module: entry.style for entry in layout.tp}, sequence_parallel=False,
             loss_parallel=False, block_names=list(layout.blocks))
    output = model(source, target)
    output.square().mean().backward()
    reference = _grads(whole)
    return {"output": (output - expected).abs().max().item(),
            "param_grads": max((grad - reference[name]).abs().max().item() for name, grad in _grads(model).items()),
            "split": float(sum(entry.style == "multihead_attention" for entry in layout.tp) == 6)}


class _GatedHeads(nn.Module):
    """An attention-like module whose ``gate`` child (layers no plan splits) feeds the output differentiably."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = 4
        self.q_proj, self.o_proj = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.gate = nn.Sequential(nn.Linear(WIDTH, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.q_proj(x)) * self.gate(x)


def _whole_child_with_gradient(mesh) -> dict[str, float]:
    """The whole child's output carries a gradient: the first forward stops, naming it (1.0), instead of training
    with each rank's part of its gradient."""
    from lightning_nd.tensor_parallel.apply.model import apply_tp

    module = _GatedHeads()
    apply_tp(module, mesh, {"q_proj": "colwise", "o_proj": "rowwise"}, sequence_parallel=False, loss_parallel=False,
             block_names=[])
    try:
        module(torch.randn(BATCH, LENGTH, WIDTH))
    except RuntimeError as error:
        return {"refused": float("`gate` runs whole on every tp rank" in str(error) and "HINT" in str(error))}
    return {"refused": 0.0}



class _ScaledMLP(nn.Module):
    """nGPT's MLP (Dory's): each inner feature scaled by a learned vector the module owns."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(WIDTH, 2 * WIDTH)
        self.down_proj = nn.Linear(2 * WIDTH, WIDTH)
        self.suv_gate, self.suv_up = nn.Parameter(torch.rand(2 * WIDTH)), nn.Parameter(torch.rand(2 * WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x) * self.suv_gate) * (self.up_proj(x) * self.suv_up))


class _ScaledBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"mlp": _ScaledMLP()}) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer["mlp"](x)
        return x


def _per_feature_scales(mesh) -> dict[str, float]:
    """The MLP's own per-feature vectors, planned by no plan of ours, split with its features (``per_head_params``)
    against the model whole in float64: largest differences of output and gradients."""
    from lightning_nd import ParallelConfig, ParallelDims, plan_layout
    from lightning_nd.tensor_parallel.apply.model import apply_tp

    torch.manual_seed(0)
    model = _ScaledBlocks().double()
    whole = copy.deepcopy(model)
    x = torch.randn(BATCH, LENGTH, WIDTH, dtype=torch.float64)
    whole(x).square().mean().backward()
    layout = plan_layout(model, ParallelDims(tp=2, world_size=2), ParallelConfig())
    apply_tp(model, mesh, {entry.module: entry.style for entry in layout.tp}, sequence_parallel=False,
             loss_parallel=False, block_names=list(layout.blocks))
    output = model(x)
    output.square().mean().backward()
    reference = _grads(whole)
    return {"output": (output - whole(x)).abs().max().item(),
            "param_grads": max((grad - reference[name]).abs().max().item() for name, grad in _grads(model).items()),
            "split": float({entry.module: entry.style for entry in layout.tp}.get("layers.0.mlp") == "per_head_params")}
