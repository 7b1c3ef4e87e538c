"""Model state per rank: parameters, gradients and optimizer state, as FSDP2 holds them here, and the ZeRO
paper's accounting of the same for comparison with the literature.

As this project allocates it (`parallel/fsdp.py`): every parameter a rank holds is its local shard
(`Layout.ranks[r].params`: after pp, tp, ep and FSDP cut it; FSDP pads its storage to the first shard's size)
in the parameter's own dtype, fp32 under ``bf16-mixed`` (FSDP casts to bf16 only for compute, so the sharded
fp32 parameters are the master weights); the gradient of each is a tensor of the same shape and dtype; the
optimizer keeps its moments in that dtype too (AdamW: two), plus a 0-dim fp32 step counter per tensor where
torch's optimizer keeps one. FSDP also gathers full (unsharded over FSDP) parameters in ``param_dtype`` for
compute: one unit at a time at zero 3, every unit of the stage from forward to backward at zero 1 and 2.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_nd.layout.record import Layout, RankHolding

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "adagrad": 1, "rmsprop": 1}
"""Tensors of a parameter's shape each optimizer keeps (torch's implementations; SGD without momentum none)."""
STEP_COUNTERS = {"adamw": True, "adam": True, "sgd": False, "sgd_momentum": False, "adagrad": True, "rmsprop": True}
STEP_COUNTER_BYTES = 4
ZERO_PAPER_K = 12
"""The ZeRO paper's optimizer bytes per parameter under mixed-precision Adam: fp32 master, momentum, variance."""


@dataclass(frozen=True)
class ModelState:
    """One rank's model state, in bytes."""

    params_bytes: int
    """Local shards, as ``to_local()`` sees them (``params_allocated_bytes`` adds FSDP's padding)."""
    grads_bytes: int
    optimizer_bytes: int
    params_allocated_bytes: int
    gathered_bytes: int
    """Full parameters FSDP holds gathered at the forward's end (in param_dtype): every unit of the stage at
    zero 1 and 2; at zero 3 the root unit and the last block only."""
    largest_unit_bytes: int
    """The largest FSDP unit's gathered parameters: what zero 3 gathers at once."""
    unit_grads_bytes: int
    """That unit's unsharded gradients (param_dtype) and the reduce-scatter's input (reduce_dtype), in backward."""
    stage_grads_bytes: int
    """Every unit's unsharded gradients in reduce_dtype: what accumulates over pp's microbatches, or zero 1's
    accumulation window."""

    @property
    def total_bytes(self) -> int:
        return self.params_allocated_bytes + self.grads_bytes + self.optimizer_bytes


def check_optimizer(name: str) -> str:
    if name not in OPTIMIZER_STATES:
        raise ValueError(f"`optimizer={name!r}` is not one the cost model knows. HINT: use one of"
                         f" {', '.join(OPTIMIZER_STATES)} (sgd_momentum = SGD with momentum > 0).")
    return name


def model_state(layout: Layout, rank: int, optimizer: str = "adamw") -> ModelState:
    """What ``rank`` holds of the model and its optimizer in ``layout``."""
    holding, options = layout.rank(rank), layout.options
    states = OPTIMIZER_STATES[check_optimizer(optimizer)]
    params = holding.param_bytes
    counters = len(holding.params) * STEP_COUNTER_BYTES if STEP_COUNTERS[optimizer] else 0
    own = DTYPE_BYTES.get(holding.params[0].dtype, 4) if holding.params else 4
    gather, reduce = (DTYPE_BYTES.get(dtype or "", own) for dtype in (options.param_dtype, options.reduce_dtype))
    units = unit_elements(layout, holding) if fsdp_on(layout) else [0]
    # zero 1 and 2 keep every unit gathered from forward to backward; so does the pipeline's backward at zero 3
    # (it turns resharding after backward off until the last microbatch).
    everything = options.zero_stage in (1, 2) or layout.dims["pp"] > 1
    kept = units if everything or len(units) < 2 else [units[0], units[-1]]
    return ModelState(
        params_bytes=params, grads_bytes=params, optimizer_bytes=states * params + counters,
        params_allocated_bytes=holding.padded_param_bytes, gathered_bytes=sum(kept) * gather,
        largest_unit_bytes=max(units) * gather, unit_grads_bytes=max(units) * (gather + reduce),
        stage_grads_bytes=sum(units) * reduce,
    )


def fsdp_on(layout: Layout) -> bool:
    return any(t.technique in ("fsdp", "hsdp") for t in layout.techniques)


def unit_elements(layout: Layout, holding: RankHolding) -> list[int]:
    """Elements of each FSDP unit of this rank when gathered (root unit first, then the blocks in order): one
    unit per block, the rest of the stage in the root unit; what FSDP does not manage (experts that each sit on
    one rank of their ep group) is never gathered."""
    root, names = 0, frozenset(layout.blocks)
    blocks: dict[str, int] = {}
    for shard in holding.params:
        if "fsdp:Shard" not in shard.placement and "expert_dp:Shard" not in shard.placement:
            continue
        elements = shard.bytes // DTYPE_BYTES.get(shard.dtype, 4) * _fsdp_size(layout, shard.placement)
        block = block_of(shard.name, names)
        if block is None:
            root += elements
        else:
            blocks[block] = blocks.get(block, 0) + elements
    return [root, *blocks.values()]


def _fsdp_size(layout: Layout, placement: str) -> int:
    dims = layout.dims
    if "expert_dp:Shard" in placement:
        return dims["dp_replicate"] * dims["dp_shard"] * dims["cp"] // dims["ep"]
    if "fsdp:Shard" in placement:
        return dims["dp_shard"] * dims["cp"]
    return 1


def block_of(name: str, blocks: frozenset[str]) -> str | None:
    """The block (of ``blocks``, whole-model names) a parameter belongs to, from its name's prefixes."""
    end = name.find(".")
    while end != -1:
        if name[:end] in blocks:
            return name[:end]
        end = name.find(".", end + 1)
    return None


def zero_paper_bytes(params: int, devices: int, k: int = ZERO_PAPER_K) -> dict[str, float]:
    """Model-state bytes per device under the ZeRO paper's accounting (Rajbhandari et al. 2020, section 3 and
    Table 1): fp16 parameters (2 bytes), fp16 gradients (2) and K bytes of optimizer state per parameter, over
    ``devices`` data-parallel ranks. Keys: the paper's names."""
    return {
        "DP": (2 + 2 + k) * params,
        "P_os": (2 + 2) * params + k * params / devices,
        "P_os+g": 2 * params + (2 + k) * params / devices,
        "P_os+g+p": (2 + 2 + k) * params / devices,
    }
