"""What each rank holds of each parameter: local shape, placement and bytes, by arithmetic alone.

It follows what the composer does, in its order: the pipeline stage keeps its units' parameters (a weight tied
between the first and the last stage is held by both, under each one's name); tensor
parallel shards by style (colwise: dim 0, rowwise: dim 1 of a weight, packed colwise: each half of dim 0;
an embedding rowwise: dim 0); expert parallel keeps E/ep experts (dim 0 of a stack; of a list of experts, rank r
of an ep group holds the r-th E/ep of them whole and none of the others); FSDP shards what is left over
``fsdp`` (dim 0; dim 1 under a packed TP split), or experts over ``expert_dp``, HSDP replicating over
``dp_replicate``. Shards follow ``torch.chunk`` (the last ones may be short or empty, as DTensor and FSDP2
cut them); FSDP allocates every shard padded to the first one's size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from lightning_nd.layout.record import ParamShard, RankHolding
from lightning_nd.mesh.dims import ParallelDims
from lightning_nd.model.structure import is_norm, parent_name
from lightning_nd.pipeline_parallel.split import StagePlan
from lightning_nd.tensor_parallel.infer.checks import tp_split

PRECISION_PARAM_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}
ATTENTION_WORDS = ("attn", "attention")
MLP_WORDS = ("mlp", "ffn", "feed_forward", "moe", "experts")
ROUTER_WORDS = ("router", "gate")


def chunk_length(size: int, chunks: int, index: int) -> int:
    """Length of piece ``index`` when ``torch.chunk`` cuts ``size`` into ``chunks`` (empty pieces past the end)."""
    step = math.ceil(size / chunks) if size else 0
    return max(0, min(step, size - index * step))


def kind_of(name: str, module: nn.Module, blocks: tuple[str, ...], experts: Mapping[str, int]) -> str:
    """A coarse kind of parameter for summaries: embedding, attention, mlp, experts, router, norm, head, other."""
    owner = parent_name(name)
    parts = owner.lower().split(".")
    if owner in experts or _listed(owner, experts) is not None:
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


def _listed(owner: str, experts: Mapping[str, int]) -> tuple[int, int] | None:
    """(index, count) of the expert of a list of ``experts`` (name -> count) that holds module ``owner``, or None:
    a list's experts are named ``<list>.<index>``."""
    parts = owner.split(".")
    for end in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:end])
        if name in experts and parts[end].isdigit():
            return int(parts[end]), experts[name]
    return None


@dataclass(frozen=True)
class _Param:
    """What is the same on every rank for one parameter: how it is split, and over which dims."""

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    element_size: int
    tp: tuple[int, int] | None
    expert: bool
    ep_rank: int | None
    """The ep rank that holds it, for an expert of a list (None: every ep rank holds a piece)."""
    fsdp: tuple[str, int, int] | None
    """(role, size, dim) FSDP shards it over, or None."""
    placement: str
    cut_by: tuple[str, ...]
    """The index roles its piece on a rank depends on (tp, ep, and fsdp or expert_dp)."""


def rank_holdings(
    module: nn.Module,
    dims: ParallelDims,
    *,
    blocks: tuple[str, ...],
    tp_entries: Mapping[str, object],
    pipeline: StagePlan | None,
    experts: Mapping[str, int],
    precision: str | None = None,
    expert_tp: set[str] | frozenset[str] = frozenset(),
) -> tuple[RankHolding, ...]:
    """One `RankHolding` per global rank. A parameter's piece depends only on the rank's index along the roles that
    cut it (`_Param.cut_by`); equal pieces (FSDP peers of an evenly split weight, mostly) are one `ParamShard`, and
    ranks that hold the same pieces share one tuple."""
    copies = {f"{pipeline.attribute}.{last}" for _, last in pipeline.split.tied} if pipeline is not None else set()
    params = _params(module, dims, blocks, tp_entries, experts, precision, copies, expert_tp)
    inside, sizes = dims.dp_shard_in_ep, {"tp": dims.tp, "ep": dims.ep}
    pieces = _Pieces(sizes)
    cuts = {param.cut_by for param in params}
    by_stages: dict[tuple[int, ...], list[_Param]] = {}  # the parameters of each pp rank's stages, found once
    held: dict[tuple, tuple[ParamShard, ...]] = {}
    same: dict[tuple[int, ...], tuple[ParamShard, ...]] = {}  # ranks whose pieces are the same objects
    holdings = []
    for rank in range(dims.world_size):
        coords = dims.coordinates(rank)
        stages = tuple(pipeline.ranks[coords["pp"]]) if pipeline is not None else ()
        if stages not in by_stages:
            prefixes = _stage_prefixes(pipeline, stages)
            by_stages[stages] = [p for p in params if prefixes is None or p.name.startswith(prefixes)]
        index = {"tp": coords["tp"], "ep": coords["ep"], "fsdp": coords["dp_shard"] * dims.cp + coords["cp"],
                 "expert_dp": coords["dp_replicate"] * (dims.dp_shard // inside) + coords["dp_shard"] // inside}
        key = (stages, *index.values())
        if key not in held:
            where = {cut: tuple(index[role] for role in cut) for cut in cuts}
            shards = [pieces.shard(param, index, where[param.cut_by]) for param in by_stages[stages]
                      if param.ep_rank in (None, index["ep"])]
            held[key] = same.setdefault(tuple(map(id, shards)), tuple(shards))
        holdings.append(RankHolding(rank, coords, stages, held[key]))
    return tuple(holdings)


class _Pieces:
    """A rank's `ParamShard` of a parameter, for one layout: each distinct piece computed and built once."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes
        self.found: dict[tuple[str, tuple[int, ...]], ParamShard] = {}  # by (name, index along its cut_by)
        self.shapes: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.shards: dict[tuple, ParamShard] = {}

    def shard(self, param: _Param, index: dict[str, int], at: tuple[int, ...]) -> ParamShard:
        """``at``: the rank's index along ``param.cut_by``."""
        found = self.found.get((param.name, at))
        if found is None:
            found = self.found[(param.name, at)] = self._build(param, index, at)
        return found

    def _build(self, param: _Param, index: dict[str, int], at: tuple[int, ...]) -> ParamShard:
        geometry = (param.shape, param.tp, param.expert, param.fsdp, at)
        if geometry not in self.shapes:
            self.shapes[geometry] = _local_shapes(param, index, self.sizes)
        shape, padded = self.shapes[geometry]
        key = (param.name, shape, padded)
        if key not in self.shards:
            self.shards[key] = ParamShard(
                name=param.name, kind=param.kind, shape=param.shape, local_shape=shape, placement=param.placement,
                dtype=param.dtype, bytes=math.prod(shape) * param.element_size,
                padded_bytes=math.prod(padded) * param.element_size)
        return self.shards[key]


def _params(module: nn.Module, dims: ParallelDims, blocks: tuple[str, ...], tp_entries: Mapping[str, object],
            experts: Mapping[str, int], precision: str | None, copies: set[str], expert_tp: set[str] | frozenset[str]
            ) -> list[_Param]:
    """Every parameter once, and under pp a tied weight's copy on the last stage too (``copies``: its names)."""
    modules = dict(module.named_modules())
    dtype_override = PRECISION_PARAM_DTYPES.get(str(precision))
    fsdp_on = dims.dp_enabled or dims.fsdp_enabled
    params, seen = [], set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in seen and name not in copies:
            continue
        seen.add(id(param))
        owner = modules[parent_name(name)]
        split = tp_split(owner, name.rsplit(".", 1)[-1], tp_entries.get(parent_name(name))) if dims.tp > 1 else None
        if parent_name(name) in expert_tp:  # gate_up_proj [E, 2I, H] part by part on dim 1, down_proj [E, H, I] on 2
            split = (1, 2) if name.endswith("gate_up_proj") else (2, 1)
        listed = _listed(parent_name(name), experts) if dims.ep > 1 else None
        expert = (parent_name(name) in experts or listed is not None) and dims.ep > 1
        ep_rank = listed[0] * dims.ep // listed[1] if listed is not None else None
        placement = [f"tp:{'StridedShard' if split[1] > 1 else 'Shard'}({split[0]})"] if split else []
        placement += [f"ep:on rank {ep_rank}" if listed is not None else "ep:Shard(0)"] if expert else []
        fsdp = None
        if fsdp_on and not (expert and dims.expert_dp == 1):
            dim = 1 if split is not None and split[1] > 1 and split[0] == 0 and param.ndim > 1 else 0
            fsdp = ("expert_dp", dims.expert_dp, dim) if expert else ("fsdp", dims.dp_shard * dims.cp, dim)
            placement += ["dp_replicate:Replicate"] if dims.dp_replicate > 1 and not expert else []
            placement.append(f"{fsdp[0]}:Shard({dim})")
        dtype = dtype_override if dtype_override is not None and param.is_floating_point() else param.dtype
        params.append(_Param(name, kind_of(name, owner, blocks, experts), tuple(param.shape),
                             str(dtype).removeprefix("torch."), dtype.itemsize, split,
                             expert, ep_rank, fsdp, " ".join(placement) or "replicated",
                             ("tp",) * (split is not None) + ("ep",) * (expert and listed is None)
                             + ((fsdp[0],) if fsdp else ())))
    return params


def _local_shapes(param: _Param, index: dict[str, int], sizes: dict[str, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's piece of ``param`` (local, padded): tp, then ep, then FSDP cut the local tensor, FSDP padding
    to the first piece."""
    shape = list(param.shape)
    if param.tp is not None:
        shape[param.tp[0]] = chunk_length(shape[param.tp[0]], sizes["tp"], index["tp"])
    if param.expert and param.ep_rank is None:
        shape[0] = chunk_length(shape[0], sizes["ep"], index["ep"])
    padded = list(shape)
    if param.fsdp is not None and shape:
        role, size, dim = param.fsdp
        padded[dim] = math.ceil(shape[dim] / size) if shape[dim] else 0
        shape[dim] = chunk_length(shape[dim], size, index[role])
    return tuple(shape), tuple(padded)


def _stage_prefixes(pipeline: StagePlan | None, stages: tuple[int, ...]) -> tuple[str, ...] | None:
    """Name prefixes of the units this rank's stages hold (None: no pipeline, every parameter is here)."""
    if pipeline is None:
        return None
    return tuple(f"{pipeline.attribute}.{unit}." for index in stages for unit in pipeline.split.stages[index])
