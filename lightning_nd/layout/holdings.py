"""What each rank holds of each parameter: local shape, placement and bytes, by arithmetic alone.

It follows what the composer does, in its order: the pipeline stage keeps its units' parameters; tensor
parallel shards by style (colwise: dim 0, rowwise: dim 1 of a weight, packed colwise: each half of dim 0;
an embedding rowwise: dim 0); expert parallel keeps E/ep experts (dim 0); FSDP shards what is left over
``fsdp`` (dim 0; dim 1 under a packed TP split), or experts over ``expert_dp``, HSDP replicating over
``dp_replicate``. Shards follow ``torch.chunk`` (the last ones may be short or empty, as DTensor and FSDP2
cut them); FSDP allocates every shard padded to the first one's size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from lightning_nd.layout.dims import ParallelDims
from lightning_nd.layout.record import ParamShard, RankHolding, StagePlan
from lightning_nd.layout.structure import is_norm, parent_name

PRECISION_PARAM_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}
ATTENTION_WORDS = ("attn", "attention")
MLP_WORDS = ("mlp", "ffn", "feed_forward", "moe", "experts")
ROUTER_WORDS = ("router", "gate")


def chunk_length(size: int, chunks: int, index: int) -> int:
    """Length of piece ``index`` when ``torch.chunk`` cuts ``size`` into ``chunks`` (empty pieces past the end)."""
    step = math.ceil(size / chunks) if size else 0
    return max(0, min(step, size - index * step))


def tp_split(module: nn.Module, param_name: str, style: object) -> tuple[int, bool] | None:
    """(dim, strided) that a tp style splits this parameter on; None when it stays whole on every tp rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "packed_colwise":
        return 0, True
    colwise = style in ("colwise", "colwise_gather_output") or isinstance(style, ColwiseParallel)
    rowwise = style in ("rowwise", "embedding_rowwise") or isinstance(style, RowwiseParallel)
    if isinstance(module, nn.Embedding):
        return (1, False) if colwise else (0, False) if rowwise else None
    if colwise:
        return 0, False
    if rowwise and param_name == "weight":
        return 1, False
    return None


def kind_of(name: str, module: nn.Module, blocks: tuple[str, ...], experts: set[str]) -> str:
    """A coarse kind of parameter for summaries: embedding, attention, mlp, experts, router, norm, head, other."""
    owner = parent_name(name)
    parts = owner.lower().split(".")
    if owner in experts:
        return "experts"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if is_norm(module):
        return "norm"
    if not any(owner.startswith(block + ".") or owner == block for block in blocks):
        return "head" if isinstance(module, nn.Linear) else "other"
    if any(word in part for part in parts for word in ATTENTION_WORDS):
        return "attention"
    if parts[-1] in ROUTER_WORDS:
        return "router"
    if any(word in part for part in parts for word in MLP_WORDS):
        return "mlp"
    return "other"


def rank_holdings(
    module: nn.Module,
    dims: ParallelDims,
    *,
    blocks: tuple[str, ...],
    tp_entries: Mapping[str, object],
    pipeline: StagePlan | None,
    experts: set[str],
    precision: str | None = None,
) -> tuple[RankHolding, ...]:
    """One `RankHolding` per global rank."""
    modules = dict(module.named_modules())
    dtype_override = PRECISION_PARAM_DTYPES.get(str(precision))
    params = [(name, param, modules[parent_name(name)]) for name, param in module.named_parameters()]
    kinds = {name: kind_of(name, owner, blocks, experts) for name, _, owner in params}
    fsdp_on = dims.dp_enabled or dims.fsdp_enabled
    inside = dims.ep // dims.cp if dims.ep > 1 else 1
    expert_dp = dims.dp_replicate * dims.dp_shard // inside
    holdings = []
    for rank in range(dims.world_size):
        coords = dims.coordinates(rank)
        stages = tuple(pipeline.ranks[coords["pp"]]) if pipeline is not None else ()
        prefixes = _stage_prefixes(pipeline, stages)
        fsdp_index = coords["dp_shard"] * dims.cp + coords["cp"]
        expert_dp_index = coords["dp_replicate"] * (dims.dp_shard // inside) + coords["dp_shard"] // inside
        shards = []
        for name, param, owner in params:
            if prefixes is not None and not name.startswith(prefixes):
                continue
            shape, placement = list(param.shape), []
            split = tp_split(owner, name.rsplit(".", 1)[-1], tp_entries.get(parent_name(name))) if dims.tp > 1 else None
            if split is not None:
                dim, strided = split
                shape[dim] = chunk_length(shape[dim], dims.tp, coords["tp"])
                placement.append(f"tp:{'StridedShard' if strided else 'Shard'}({dim})")
            padded = list(shape)
            is_expert = parent_name(name) in experts and dims.ep > 1
            if is_expert:
                shape[0] = padded[0] = chunk_length(shape[0], dims.ep, coords["ep"])
                placement.append("ep:Shard(0)")
            if fsdp_on and not (is_expert and expert_dp == 1):
                role, size, index = ("expert_dp", expert_dp, expert_dp_index) if is_expert else (
                    "fsdp", dims.dp_shard * dims.cp, fsdp_index)
                dim = 1 if split is not None and split[1] and len(shape) > 1 else 0
                if dims.dp_replicate > 1 and not is_expert:
                    placement.append("dp_replicate:Replicate")
                if shape:
                    padded[dim] = math.ceil(shape[dim] / size) if shape[dim] else 0
                    shape[dim] = chunk_length(shape[dim], size, index)
                placement.append(f"{role}:Shard({dim})")
            dtype = dtype_override if dtype_override is not None and param.is_floating_point() else param.dtype
            size_of = torch.empty((), dtype=dtype).element_size()
            shards.append(ParamShard(
                name=name, kind=kinds[name], shape=tuple(param.shape), local_shape=tuple(shape),
                placement=" ".join(placement) or "replicated", dtype=str(dtype).removeprefix("torch."),
                bytes=math.prod(shape) * size_of, padded_bytes=math.prod(padded) * size_of,
            ))
        holdings.append(RankHolding(rank, coords, stages, tuple(shards)))
    return tuple(holdings)


def _stage_prefixes(pipeline: StagePlan | None, stages: tuple[int, ...]) -> tuple[str, ...] | None:
    """Name prefixes of the units this rank's stages hold (None: no pipeline, every parameter is here)."""
    if pipeline is None:
        return None
    return tuple(f"{pipeline.attribute}.{unit}." for index in stages for unit in pipeline.split.stages[index])
