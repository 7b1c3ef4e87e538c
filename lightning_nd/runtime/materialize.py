"""Turn a sharded meta-device model into real tensors, each rank allocating only its own shards, as the model plain
construction gives.

``to_empty`` allocates the local shards, keeping every tie (`ties.py`); the tensors construction made as constants
get their values (`init_constants.py`); every module's ``reset_parameters()`` fills them, a tensor shared by several modules by the module that created it; then the model's own init entry points run
again (`model_init.py`, recorded while the model was built: `init_record.py`). Every draw is seeded per shard
(`shard_seeds.py`), so shards differ and replicas agree on CPU meshes too.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from lightning_nd.runtime.init_replay import replay
from lightning_nd.runtime.model_init import ModelInit
from lightning_nd.runtime.probe import check_initialisable, own_tensors
from lightning_nd.runtime.shard_seeds import local, shard_identity, shard_seed
from lightning_nd.runtime.ties import shared_tensors, tensor_slots, to_empty_keeping_ties


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in own_tensors(module))


def materialize(module: nn.Module, device: torch.device, seed: int = 0, init: ModelInit | None = None,
                original_name: Callable[[str], str] | None = None) -> None:
    """Allocate and initialise every meta tensor of ``module``, each rank only its shards.

    ``init``: what building the model recorded (`InitRecorder.resolve`); ``original_name``: this rank's module and
    tensor names -> the whole model's (under pp the stages hold copies of the model).
    """
    if not has_meta(module):
        return
    init = init or ModelInit()
    name_of = original_name or (lambda name: name)
    check_initialisable(module, init, name_of)
    to_empty_keeping_ties(module, device)
    _fill_constants(module, dict(init.constants), name_of)
    initialisers = _initialisers(module, dict(init.creators), name_of)
    cuda_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=cuda_devices), warnings.catch_warnings():
        # torch's warning is about exactly the gap the per-shard seeds close on CPU meshes.
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support on cpu")
        for path, submodule in module.named_modules():
            own = list(own_tensors(submodule, recurse=False))
            if not own or not callable(getattr(submodule, "reset_parameters", None)):
                continue
            others = {id(t): local(t).clone() for t in own if initialisers.get(id(t), submodule) is not submodule}
            _reset_per_identity(submodule, own, seed, name_of(path))
            for tensor in own:
                if id(tensor) in others:
                    local(tensor).copy_(others[id(tensor)])
        replay(module, init.calls, seed, device, name_of)


@torch.no_grad()
def _fill_constants(module: nn.Module, constants: dict[str, bool | int | float], name_of: Callable[[str], str]) -> None:
    """The tensors construction made as constants get their values back; a ``reset_parameters()`` or an init entry
    point that initialises one runs after, as in plain construction."""
    for name, _, tensor in tensor_slots(module):
        if name_of(name) in constants:
            local(tensor).fill_(constants[name_of(name)])


def _initialisers(module: nn.Module, creators: dict[str, str], name_of: Callable[[str], str]) -> dict[int, nn.Module]:
    """For each tensor several modules hold, the one whose ``reset_parameters()`` initialises it: the module that
    created it, as in plain construction (``head.weight = embedding.weight`` keeps the embedding's values), else the
    first holder that has one."""
    paths = {id(m): name_of(path) for path, m in module.named_modules()}
    names: dict[int, str] = {}
    for name, _, tensor in tensor_slots(module):
        names.setdefault(id(tensor), name_of(name))
    chosen: dict[int, nn.Module | None] = {}
    for key, holders in shared_tensors(module).items():
        able = [holder for holder, _, _ in holders if callable(getattr(holder, "reset_parameters", None))]
        creator = creators.get(names[key])
        chosen[key] = next((holder for holder in able if paths.get(id(holder)) == creator), able[0] if able else None)
    return {key: holder for key, holder in chosen.items() if holder is not None}


@torch.no_grad()
def _reset_per_identity(submodule: nn.Module, own: list[torch.Tensor], seed: int, path: str) -> None:
    """One ``reset_parameters()`` per distinct shard identity among the module's tensors, each kept
    only for the tensors of that identity (usually one pass; two for e.g. a rowwise weight + bias). The draws are
    keyed by the module's name in the whole model, so no two modules draw alike, whichever modules a rank holds
    (under pp, block 0 of one stage and block 0 of another are different blocks)."""
    identities = {id(t): shard_identity(t) for t in own}
    if len(set(identities.values())) == 1:
        torch.manual_seed(shard_seed(seed, path, next(iter(identities.values()))))
        # `materialize` checked that the module has a callable `reset_parameters`, which `nn.Module` does not declare.
        cast("Callable[[], None]", submodule.reset_parameters)()
        return
    kept: dict[int, torch.Tensor] = {}
    for identity in dict.fromkeys(identities.values()):
        torch.manual_seed(shard_seed(seed, path, identity))
        cast("Callable[[], None]", submodule.reset_parameters)()
        for tensor in own:
            if identities[id(tensor)] == identity:
                kept[id(tensor)] = local(tensor).clone()
    for tensor in own:
        local(tensor).copy_(kept[id(tensor)])
