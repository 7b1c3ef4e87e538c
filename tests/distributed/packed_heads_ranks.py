"""Run on each of 2 ranks: a fused ``[q; k; v]`` sized by head counts, split by heads over tp against the whole model
in one process, float64 (tests/distributed/test_tp_packed_heads.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.models import VOCAB

LITGPT = {
    # case -> (config of tests/distributed/litgpt_models.py, fields replaced)
    "grouped_biases": ("llama3", {"bias": True}),                   # 4 heads, 2 key/value heads, both layers' biases
    "four_per_group": ("llama3", {"n_head": 8, "head_size": 6}),    # 8 heads, 2 key/value heads
    "multi_head": ("pythia", {}),                                   # 4 heads, 4 key/value heads: nothing gathered
}


class Attention(nn.Module):
    """Another codebase's grouped-query attention: its counts on itself, one fused ``wqkv``."""

    def __init__(self, width: int, heads: int = 8, kv_heads: int = 2) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, width // heads
        self.wqkv = nn.Linear(width, (heads + 2 * kv_heads) * self.head_dim)
        self.proj_out = nn.Linear(heads * self.head_dim, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.wqkv(x).split([self.num_heads * self.head_dim, self.num_key_value_heads * self.head_dim,
                                      self.num_key_value_heads * self.head_dim], dim=-1)
        q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = (t.view(batch, seq, self.num_key_value_heads, self.head_dim).transpose(1, 2)
                .repeat_interleave(self.num_heads // self.num_key_value_heads, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj_out(y.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.attention = nn.LayerNorm(width), Attention(width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm(x))
        return x + self.fc2(F.gelu(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self, width: int = 48) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _litgpt(key: str, fields: dict) -> nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT

    from tests.distributed.litgpt_models import LITGPT as CONFIGS
    from tests.distributed.litgpt_models import SHRINK

    name, extra = CONFIGS[key]
    torch.manual_seed(0)
    return GPT(Config.from_name(name, **{**SHRINK, **extra, **fields})).double()


def _sequence_parallel_plan(model: nn.Module) -> dict[str, str]:
    """What a LitGPT user names for sequence parallelism (its structure does not show the residual norms)."""
    blocks = "transformer.h.*."
    return {f"{blocks}attn.qkv": "packed_heads", f"{blocks}attn.proj": "rowwise_packed_heads",
            f"{blocks}mlp.fc_1": "colwise", f"{blocks}mlp.fc_2": "colwise", f"{blocks}mlp.proj": "rowwise",
            f"{blocks}norm_1": "sequence_parallel", f"{blocks}norm_2": "sequence_parallel",
            "transformer.ln_f": "sequence_parallel"}


def _compare(model: nn.Module, inputs: torch.Tensor, mesh, explicit: dict | None, sequence_parallel: bool,
             folder: Path | None = None) -> dict[str, float]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from lightning_nd.model.structure import find_blocks, read_model_facts
    from lightning_nd.tensor_parallel.apply.model import apply_tp
    from lightning_nd.tensor_parallel.infer.resolve import resolve_tp_plan

    whole = copy.deepcopy(model)
    plan = resolve_tp_plan(model, explicit, tp=mesh.size(), facts=read_model_facts(model),
                           sequence_parallel=sequence_parallel)
    apply_tp(model, mesh, plan.entries, sequence_parallel=sequence_parallel, loss_parallel=False,
             block_names=[name for name, _ in find_blocks(model)])
    full = lambda tensor: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    output, expected = full(model(inputs)), whole(inputs)
    output.square().mean().backward()
    expected.square().mean().backward()
    grads = dict(whole.named_parameters())
    fused = [param for name, param in model.named_parameters() if plan.entries.get(name.rsplit(".", 1)[0]) ==
             "packed_heads" and name.endswith("weight")]
    result = {"split": float(bool(fused) and all(isinstance(p.placements[0], _StridedShard) for p in fused)),
              "output": (output - expected).abs().max().item(),
              "grads": max((full(p.grad) - grads[n].grad).abs().max().item() for n, p in model.named_parameters())}
    if folder is not None:  # written where the whole tensors have it: the model's own order
        from lightning_nd.checkpoint import read_sharded
        from lightning_nd.checkpoint.sharded import save_sharded

        save_sharded(folder, {"model": dict(model.state_dict())}, meta={}, rng={}, info={})
        dist.barrier()
        if dist.get_rank() == 0:
            written = read_sharded(folder)["state_dict"]
            result["checkpoint"] = max((written[n] - p).abs().max().item() for n, p in whole.state_dict().items())
    return result


def compare(folder: str) -> dict[str, dict[str, float]]:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    results = {}
    for case, (key, fields) in LITGPT.items():
        results[case] = _compare(_litgpt(key, fields), tokens, mesh, None, False,
                                 Path(folder) / case if case == "grouped_biases" else None)
    results["sequence_parallel"] = _compare(_litgpt("llama3", {}), tokens, mesh,
                                            _sequence_parallel_plan(_litgpt("llama3", {})), True)
    torch.manual_seed(0)
    results["counts_on_the_module"] = _compare(Stack().double(), torch.randn(2, 16, 48, dtype=torch.float64,
                                               generator=torch.Generator().manual_seed(1)), mesh, None, False)
    dist.barrier()
    dist.destroy_process_group()
    return results
