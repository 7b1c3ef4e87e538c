"""The module each pipeline stage runs (where the model splits: `pipeline_parallel/split.py`).

A stage module is a copy of the model that keeps only its own units (the others never get copied,
so a rank materialises only its stages' weights) and still runs the model's own ``forward``:

- a unit before the blocks that this stage lacks is replaced by a stand-in that returns the
  activation received from the previous stage (right shape and dtype for whatever reads it), and
  the stage's first block is fed that activation, whatever the model computed in front of it;
- a unit after the blocks that this stage lacks passes its input through, and the stage returns
  the output of its last block;
- blocks of other stages are removed from their container, keeping the original names, so
  parameter names, plans and checkpoints refer to the same modules as in the whole model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_nd.model.structure import get_submodule, parent_name
from lightning_nd.pipeline_parallel.aux_losses import StageAuxLosses, attach
from lightning_nd.pipeline_parallel.forward_trace import hidden_argument, main_output
from lightning_nd.pipeline_parallel.layer_lists import restrict_layer_lists
from lightning_nd.pipeline_parallel.split import StageLayout


class _Slot:
    """What a stage hands between its wrapper and the stand-ins and hooks inside the copied model."""

    carried: torch.Tensor | None = None
    output: Any = None


class _Carry(nn.Module):
    """Stands in for a unit before the blocks that another stage holds: returns the received activation.

    A stand-in for an embedding answers ``weight`` with an empty tensor of its dtype, on the carried activation's
    device (no parameter, no buffer: nothing to initialise or save): models read ``self.embed_tokens.weight.device``
    before calling it (Llama 4)."""

    def __init__(self, slot: _Slot, unit: nn.Module) -> None:
        super().__init__()
        self._slot = slot
        weight = getattr(unit, "weight", None)
        self._dtype = weight.dtype if isinstance(weight, torch.Tensor) else None

    @property
    def weight(self) -> torch.Tensor:
        if self._dtype is None:
            raise AttributeError("the module this stage does not hold has no `weight`")
        carried = self._slot.carried
        return torch.empty(0, dtype=self._dtype, device=carried.device if carried is not None else None)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self._slot.carried is not None, "only a stage after the first carries a unit in"
        return self._slot.carried


class _Pass(nn.Module):
    """Stands in for a unit after the blocks that another stage holds: passes its input through."""

    def forward(self, value: Any, *args: Any, **kwargs: Any) -> Any:
        return value


def is_stand_in(module: nn.Module) -> bool:
    return isinstance(module, (_Carry, _Pass))


class StageModule(nn.Module):
    """One pipeline stage: ``module`` is the model with only this stage's units (original names)."""

    def __init__(self, model: nn.Module, layout: StageLayout, index: int) -> None:
        super().__init__()
        self.index, self.num_stages = index, len(layout.stages)
        self.is_first, self.is_last = index == 0, index == self.num_stages - 1
        own = set(layout.stages[index])
        slot = self._slot = _Slot()
        memo: dict[int, Any] = {}
        for name in layout.pre + layout.post:
            if name not in own:
                unit = get_submodule(model, name)
                memo[id(unit)] = _Carry(slot, unit) if name in layout.pre else _Pass()
        for name in layout.blocks:
            if name not in own:
                memo[id(get_submodule(model, name))] = None
        self.module = copy.deepcopy(model, memo)
        for name in layout.blocks:
            if name not in own:
                del get_submodule(self.module, parent_name(name))._modules[name.rsplit(".", 1)[-1]]
        self.block_names = [name for name in layout.blocks if name in own]
        restrict_layer_lists(self.module, layout.blocks, own)
        self.on_output: Callable[[torch.Tensor, Any, torch.Tensor | None], None] | None = None
        """Hears, on the last stage, of each microbatch's output: the tensor handed on, what the model returned and
        the stage's MoE auxiliary losses (None without MoE layers)."""
        self.aux = StageAuxLosses(self.module)
        self._loss_inputs = _loss_only_inputs(model)

    def attach(self) -> None:
        """Hook the first and last local blocks; called once the stage is parallelized, so the input is
        replaced before any other hook sees it and the output taken after every other hook (sequence
        parallel hands on a full tensor, as between a model's last block and its head)."""
        first, last = get_submodule(self.module, self.block_names[0]), get_submodule(self.module, self.block_names[-1])
        first.register_forward_pre_hook(self._feed, with_kwargs=True, prepend=True)
        last.register_forward_hook(self._capture)

    def _feed(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        carried = self._slot.carried
        if carried is None:
            return None
        key = hidden_argument(args, kwargs, carried)
        if key == "0":
            return (carried, *args[1:]), kwargs
        if key is None:
            raise ValueError(f"Pipeline stage {self.index}: block `{self.block_names[0]}` was called with keyword"
                             f" arguments only ({', '.join(kwargs)}), none of which looks like the hidden states."
                             " HINT: pass the hidden states positionally or as `hidden_states=`.")
        return args, {**kwargs, key: carried}

    def _capture(self, block: nn.Module, args: tuple, output: Any) -> None:
        self._slot.output = output

    def forward(self, *carried: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """``carried``: the previous stage's activation (none on the first stage); ``inputs``: the
        model's own inputs (``_arg0``, ``_arg1``... positional, other names keyword) on every stage."""
        args = [inputs.pop(f"_arg{i}") for i in range(sum(1 for k in inputs if k.startswith("_arg")))]
        self._slot.carried = None if self.is_first else carried[0]
        if not self.is_last:  # the model's own loss is computed on the last stage only
            inputs = {k: (None if k in self._loss_inputs else v) for k, v in inputs.items()}
        self.aux.reset()
        try:
            output = self.module(*args, **inputs)
            main = main_output(output if self.is_last else self._slot.output)
            aux = self.aux.collect()
            if self.is_last and self.on_output is not None:
                self.on_output(main, output, aux)
            elif not self.is_last and aux is not None and self.aux.scale and torch.is_grad_enabled():
                main = attach(main, aux, self.aux.scale)
            return main
        finally:
            self._slot.carried = self._slot.output = None


def _loss_only_inputs(model: nn.Module) -> tuple[str, ...]:
    """Arguments a model uses for its loss alone: a Hugging Face model's ``labels`` ("labels for computing the
    language modeling loss", its documented meaning). Earlier stages get None: their stand-in head would hand
    the hidden states to the loss."""
    is_hf = any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)
    return ("labels",) if is_hf and hasattr(model, "loss_function") else ()


class PipelineStages(nn.Module):
    """The stage modules one rank runs (two or more with looped and V-shaped schedules)."""

    def __init__(self, stages: Sequence[StageModule]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)

    @staticmethod
    def original_name(name: str) -> str:
        """``stages.0.module.layers.3.w`` -> ``layers.3.w``: the name in the whole model."""
        parts = name.split(".")
        return ".".join(parts[3:]) if parts[:1] == ["stages"] and parts[2:3] == ["module"] else name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("A pipelined model runs through its schedule (`NDParallel` drives it), not by calling it."
                           " HINT: use `trainer.predict` for outputs.")


def pack_inputs(inputs: Any) -> dict[str, Any]:
    """A model's inputs as keyword arguments every stage receives: tensor, tuple (positional) or dict."""
    if isinstance(inputs, Mapping):
        return dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return {f"_arg{i}": value for i, value in enumerate(inputs)}
    return {"_arg0": inputs}
