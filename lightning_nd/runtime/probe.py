"""What the strategy and the dry run learn about the user's module before planning: the module to plan (a
`configure_model` built on a meta-device copy) and whether the user parallelized it already. A LightningModule is
recognised by its class hierarchy, so neither this file nor the dry run imports Lightning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from typing import cast

import torch

from lightning_nd.model.structure import torch_class
from lightning_nd.runtime.init_record import InitRecorder
from lightning_nd.runtime.model_init import Lost, ModelInit, scratch_copy
from lightning_nd.runtime.ties import tensor_slots

log = logging.getLogger("lightning_nd")


def lightning_base(module: torch.nn.Module) -> type | None:
    """The `LightningModule` class ``module`` derives from, or None for a plain ``nn.Module``."""
    return next((cls for cls in type(module).__mro__ if cls.__name__ == "LightningModule"), None)


def builds_in_configure_model(module: torch.nn.Module) -> bool:
    """A LightningModule whose class overrides `configure_model` (as Lightning's ``is_overridden`` tells)."""
    base = lightning_base(module)
    return base is not None and getattr(type(module), "configure_model", None) is not getattr(base, "configure_model")


def model_to_check(model: torch.nn.Module, on_meta: bool = True) -> torch.nn.Module | None:
    """The module `plan_layout` plans before any process group exists.

    A model built in `configure_model` does not exist yet: build it on a meta-device copy. If that
    hook needs the running job (it reads `self.device_mesh`), None: the strategy plans in `setup`.
    ``on_meta``: the run builds it on the meta device too, so what materialising it could not give again
    (`InitRecorder`) is refused here.
    """
    if any(True for _ in model.parameters()) or not builds_in_configure_model(model):
        return model
    recorder = InitRecorder()
    try:
        probe = scratch_copy(model)
        with recorder if on_meta else nullcontext(), torch.device("meta"):
            cast("Callable[[], None]", probe.configure_model)()  # a LightningModule's, as checked above
    except Exception as error:  # the hook needs the process group; `setup` plans the real model
        log.debug("configure_model could not run before the processes start (%s); planning in setup", error)
        return None
    if not any(True for _ in probe.parameters()):
        return None
    if on_meta:
        check_initialisable(probe, recorder.resolve(probe))
    return probe


def already_parallel(module: torch.nn.Module) -> bool:
    """The user sharded it already (FSDP2 modules or DTensor parameters); neither exists before torch's module is
    loaded, so nothing is imported to answer."""
    fsdp_module = torch_class("torch.distributed.fsdp", "FSDPModule")
    dtensor = torch_class("torch.distributed.tensor", "DTensor")
    if fsdp_module is not None and any(isinstance(m, fsdp_module) for m in module.modules()):
        return True
    return dtensor is not None and any(isinstance(p, dtensor) for p in module.parameters())


def own_tensors(module: torch.nn.Module, recurse: bool = True) -> Iterator[torch.Tensor]:
    """The parameters, then the buffers."""
    yield from module.parameters(recurse=recurse)
    yield from module.buffers(recurse=recurse)


def uninitialisable(module: torch.nn.Module, init: ModelInit | None = None,
                    original_name: Callable[[str], str] | None = None) -> list[str]:
    """Classes of modules that own parameters or buffers a meta-device build could not initialise
    (no ``reset_parameters()``, no other module that does initialises the same tensor, the model's own init
    entry points, ``init.covered`` by the whole model's names, do not either, and it was not made as a constant)."""
    name_of = original_name or (lambda name: name)
    covered = {
        id(t) for m in module.modules() if callable(getattr(m, "reset_parameters", None)) for t in own_tensors(m, False)
    }
    if init is not None:
        given = init.covered | {name for name, _ in init.constants}
        covered |= {id(t) for name, _, t in tensor_slots(module) if name_of(name) in given}
    return sorted({
        type(m).__name__ for m in module.modules()
        if not callable(getattr(m, "reset_parameters", None)) and any(id(t) not in covered for t in own_tensors(m, False))
    })


def check_initialisable(module: torch.nn.Module, init: ModelInit | None = None,
                        original_name: Callable[[str], str] | None = None) -> None:
    """Raise, naming the fix, when materialising ``module`` would leave uninitialised memory, or would give a tensor
    other values than the model's own initialisation gave it (``init.lost``)."""
    if init is not None and init.lost:
        raise ValueError(lost_message(init.lost))
    missing = uninitialisable(module, init, original_name)
    if missing:
        raise ValueError(
            f"The model is built on the meta device (in `configure_model`), but {', '.join(missing)} cannot be"
            " initialised there: they own parameters or buffers and have no `reset_parameters()`."
            " HINT: give them a `reset_parameters()`, build the model in `__init__`, or pass"
            " `NDParallel(init_on_meta=False)` to run `configure_model` on the real device."
        )


SHOWN = 8


def lost_message(lost: Sequence[Lost]) -> str:
    shown = ", ".join(f"`{item.tensor}` ({item.where})" for item in lost[:SHOWN])
    more = f" and {len(lost) - SHOWN} more" if len(lost) > SHOWN else ""
    return (
        f"The model is built on the meta device (in `configure_model`), where it initialises {shown}{more} in a way"
        " materialising cannot repeat: each rank gives every tensor its module's `reset_parameters()`, then runs again"
        " only the init entry points the model's construction called (`init_weights()`,"
        " `self.apply(self._init_weights)`, transformers' `post_init()`), and these values come from elsewhere, so"
        " every layout would start from another model than the one you wrote. HINT: move that initialisation into an `init_weights()` method (or"
        " an `_init_weights(module)` applied with `self.apply`) that the model's constructor calls, build the model in"
        " `__init__`, or pass `NDParallel(init_on_meta=False)` to run `configure_model` on the real device."
    )
