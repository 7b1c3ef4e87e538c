"""Data parallelism with FSDP2: ``apply_fsdp(root, blocks, mesh, *, zero_stage, ...)``.

One FSDP unit per repeated block plus one for the root (everything left: embeddings, final norm,
head). A 1-D mesh shards (FSDP); a 2-D ``(dp_replicate, fsdp)`` mesh replicates over the
first dim and shards over the second (HSDP).

``zero_stage`` in the terms the field uses, mapped onto FSDP2:

- 3: parameters, gradients and optimizer state sharded; parameters are freed after forward and
  all-gathered again in backward (least memory, one more all-gather per step).
- 2: as 3, but parameters stay gathered from forward to backward (no second all-gather).
- 1: as 2, and under gradient accumulation the gradients of all micro-batches accumulate unsharded
  and are reduced once per optimizer step, with the parameters kept gathered in between; only the
  optimizer state (with the fp32 master weights) stays sharded across the window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypedDict

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_nd.model.structure import model_of


class _UnitOptions(TypedDict):
    """The keyword arguments of `fully_shard` every unit shares."""

    mesh: DeviceMesh | None
    ignored_params: set[nn.Parameter] | None
    shard_placement_fn: Callable[[nn.Parameter], Shard | None]
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy


def apply_fsdp(
    root: nn.Module,
    blocks: Sequence[nn.Module],
    mesh: DeviceMesh,
    *,
    zero_stage: int = 3,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    forward_methods: Iterable[str] = (),
    root_unit: nn.Module | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    experts: Sequence[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Shard ``blocks`` one by one, then the root unit (``root_unit``, else see `fsdp_root`), which
    holds everything else.

    When the root unit is ``root`` itself (its own parameters, or several children share them),
    ``forward_methods`` (a LightningModule's step methods) trigger FSDP's hooks as ``forward`` does.
    ``ignored_params`` (expert weights under ep, when each expert sits on one rank of its group) stay whole
    and local. ``experts`` with an ``expert_mesh`` (the ranks holding the same experts) become units of their
    own, sharded and their gradients averaged over it.
    """
    kwargs: _UnitOptions = {
        "mesh": mesh,
        "ignored_params": ignored_params or None,
        "shard_placement_fn": _shard_placement,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy(),
    }
    expert_kwargs: _UnitOptions = {**kwargs, "mesh": expert_mesh}
    for module in experts if expert_mesh is not None else ():
        fully_shard(module, reshard_after_forward=zero_stage == 3, **expert_kwargs)
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them.
        reshard = zero_stage == 3 and index < len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    unit = root_unit if root_unit is not None else fsdp_root(root)
    fully_shard(unit, reshard_after_forward=False, **kwargs)
    for method in forward_methods if unit is root else ():
        if callable(getattr(root, method, None)):
            register_fsdp_forward_method(root, method)


def fsdp_root(root: nn.Module) -> nn.Module:
    """The module FSDP's root unit wraps: the one child that holds every parameter (``self.model`` of a
    LightningModule), else ``root`` itself.

    Wrapping the child keeps its forward the only FSDP entry point. A step method registered as a
    forward that calls ``self(...)`` inside nests two FSDP forwards on one unit: the outer one frees
    the root's parameters when it returns, and backward gathers them a second time (measured: the
    root's parameters moved twice per step at zero_stage=2).
    """
    return model_of(root)


def _shard_placement(param: nn.Parameter) -> Shard | None:
    """FSDP shards dim 0, except under a strided TP split of dim 0 (packed projections): FSDP's
    dim-0 sharding on top of it mixed rows of the two halves (wrong gradients), so it takes dim 1.
    (GPT-2's ``Conv1D`` stores ``[in, out]``: its strided split is on dim 1, and FSDP keeps dim 0.)"""
    strided = [p.dim for p in getattr(param, "placements", ()) if isinstance(p, _StridedShard)]
    if isinstance(param, DTensor) and param.ndim > 1 and strided and strided[0] == 0:
        return Shard(1)
    return None


def fsdp_modules(root: nn.Module) -> list[FSDPModule]:
    return [module for module in root.modules() if isinstance(module, FSDPModule)]


@contextmanager
def accumulate_without_sync(root: nn.Module, zero_stage: int) -> Iterator[None]:
    """Context for the micro-batches of an accumulation window that do not end it.

    ZeRO-1 accumulates unsharded gradients locally and keeps parameters gathered; ZeRO-2/3 reduce
    every micro-batch (their point is to never hold a full gradient), so this is a no-op for them.
    """
    modules = fsdp_modules(root) if zero_stage == 1 else []
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
        module.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)
            module.set_reshard_after_backward(True, recurse=False)
