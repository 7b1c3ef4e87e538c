"""Layout-independent state: what a rank holds, under the names of the whole, unsplit model.

FSDP, TP and EP keep parameter names (their shards are DTensors that know their place in the whole
tensor). Pipeline parallelism moves the model into ``<attribute>.stages.<i>.module.``; these names
are mapped back, so a checkpoint saved under one pipeline layout loads under any other, or none.
Optimizer state is keyed by the same names (never by position), with each group's hyperparameters
kept apart from its parameter list (the list differs between pipeline ranks). A weight tied between the
first and the last stage keeps both names for its weights, as one process's state dict does, and one name
for its optimizer state, the first stage's, as one process's optimizer has: saved once, loaded into both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_nd.pipeline_parallel.stage import PipelineStages


class Names:
    """Local (this rank's module) names <-> names in the whole model, for one LightningModule. Under pp,
    ``stage_attribute`` holds the stages, ``units`` are the whole model's units in order and ``tied`` the
    split's tied weights (name on the first stage, name on the last)."""

    def __init__(self, stage_attribute: str | None = None, units: Sequence[str] = (),
                 tied: Sequence[tuple[str, str]] = ()) -> None:
        self._prefix = f"{stage_attribute}." if stage_attribute else None
        self._units = [f"{self._prefix}{unit}." for unit in units] if self._prefix else []
        self._tied = {f"{self._prefix}{last}": f"{self._prefix}{first}" for first, last in tied}

    def whole_model_order(self, names: list[str]) -> list[str]:
        """Names in the unsplit model's order (unit by unit, stable within one), as a plain run numbers them."""
        if not self._units:
            return names
        return sorted(names, key=lambda name: next((i for i, u in enumerate(self._units) if name.startswith(u)),
                                                   len(self._units)))

    def original(self, name: str) -> str:
        """A tensor's or module's name in the whole model (a stage's copy of the model: the model's own)."""
        if self._prefix is None or not name.startswith(self._prefix):
            return name
        return (self._prefix + PipelineStages.original_name(name[len(self._prefix):])).rstrip(".")

    def optimizer_name(self, name: str) -> str:
        """The whole-model name of a parameter's optimizer state: a tied copy's is the weight it copies."""
        original = self.original(name)
        return self._tied.get(original, original)

    def by_original(self, local: Iterable[str]) -> dict[str, list[str]]:
        """Each whole-model name and the local names holding it (two stages of one rank may share a buffer)."""
        grouped: dict[str, list[str]] = {}
        for name in local:
            grouped.setdefault(self.original(name), []).append(name)
        return grouped


def model_state(model: nn.Module, names: Names) -> dict[str, Tensor]:
    """The model's tensors (DTensor shards, no copies) under whole-model names."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    local = cast("dict[str, Tensor]", get_model_state_dict(model))
    return {original: local[owners[0]] for original, owners in names.by_original(local).items()}


def set_model_state(model: nn.Module, names: Names, state: Mapping[str, Tensor], strict: bool = True) -> None:
    """Put ``state`` (whole-model names, tensors shaped like this rank's own) into the model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, ValueType, set_model_state_dict

    local: dict[str, ValueType] = {
        name: state[names.original(name)] for name in get_local_names(model) if names.original(name) in state}
    set_model_state_dict(model, local, options=StateDictOptions(strict=strict))


def get_local_names(model: nn.Module) -> list[str]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return list(get_model_state_dict(model))


def optimizer_state(model: nn.Module, optimizer: Optimizer, names: Names, create: bool = False) -> dict[str, Any]:
    """``{"state": {name: {...}}, "param_groups": [hyperparameters]}``. An optimizer that has not stepped has no
    state: saved as such (torch would create it with a real zero-lr step, which changes the next update), or,
    with ``create`` (the target of a load), created so its shapes are known."""
    from torch.distributed.checkpoint.state_dict import DictValueType, ListDictValueType, get_optimizer_state_dict

    hyper = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    if not optimizer.state and not create:
        return {"state": {}, "param_groups": hyper}
    local = get_optimizer_state_dict(model, optimizer)
    return {"state": {names.optimizer_name(name): value
                      for name, value in cast(DictValueType, local["state"]).items()},
            "param_groups": [{k: v for k, v in group.items() if k != "params"}
                             for group in cast(ListDictValueType, local["param_groups"])]}


def group_names(model: nn.Module, optimizer: Optimizer, names: Names) -> list[list[str]]:
    """The whole-model names of each group's parameters on this rank, in the optimizer's order."""
    return [[names.optimizer_name(name) for name in group] for group in _local_group_names(model, optimizer)]


def _local_group_names(model: nn.Module, optimizer: Optimizer) -> list[list[str]]:
    """Each group's parameters by their state-dict names in ``model`` (found by identity: no state is created)."""
    by_id = {id(param): _state_dict_name(name) for name, param in model.named_parameters()}
    return [[by_id[id(param)] for param in group["params"]] for group in optimizer.param_groups]


def _state_dict_name(name: str) -> str:
    """A parameter's name in the state dict: without the wrappers activation checkpointing and compile add."""
    return ".".join(part for part in name.split(".") if part not in ("_checkpoint_wrapped_module", "_orig_mod"))


def set_optimizer_state(model: nn.Module, optimizer: Optimizer, names: Names, state: Mapping[str, Any],
                        full: bool = False) -> None:
    """Load ``state`` (as `optimizer_state` returns it, whole tensors when ``full``) into the optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    local_groups = _local_group_names(model, optimizer)
    if len(local_groups) != len(state["param_groups"]):
        raise ValueError(
            f"The checkpoint's optimizer has {len(state['param_groups'])} parameter groups, this one has"
            f" {len(local_groups)}. HINT: `configure_optimizers` must build the same groups as the run that saved it."
        )
    local_state, taken = {}, set()
    for name in (name for group in local_groups for name in group if names.optimizer_name(name) in state["state"]):
        value = state["state"][names.optimizer_name(name)]
        # Two copies of one tied weight on this rank (a V-shaped schedule) must not share state tensors.
        local_state[name] = {k: v.clone() if isinstance(v, Tensor) else v for k, v in value.items()} if (
            names.optimizer_name(name) in taken) else value
        taken.add(names.optimizer_name(name))
    groups = [{**saved, "params": group} for saved, group in zip(state["param_groups"], local_groups)]
    set_optimizer_state_dict(model, optimizer, {"state": local_state, "param_groups": groups},
                             options=StateDictOptions(full_state_dict=full))
