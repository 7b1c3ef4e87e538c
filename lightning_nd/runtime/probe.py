"""What the strategy and the dry run learn about the user's module before planning: the module to plan (a
`configure_model` built on a meta-device copy) and whether the user parallelized it already. A LightningModule is
recognised by its class hierarchy, so neither this file nor the dry run imports Lightning.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch.distributed.tensor import DTensor

from lightning_nd.runtime.materialize import check_initialisable

log = logging.getLogger("lightning_nd")


def lightning_base(module: torch.nn.Module) -> type | None:
    """The `LightningModule` class ``module`` derives from, or None for a plain ``nn.Module``."""
    return next((cls for cls in type(module).__mro__ if cls.__name__ == "LightningModule"), None)


def builds_in_configure_model(module: torch.nn.Module) -> bool:
    """A LightningModule whose class overrides `configure_model` (as Lightning's ``is_overridden`` tells)."""
    base = lightning_base(module)
    return base is not None and getattr(type(module), "configure_model", None) is not getattr(base, "configure_model")


def model_to_check(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module `plan_layout` plans before any process group exists.

    A model built in `configure_model` does not exist yet: build it on a meta-device copy. If that
    hook needs the running job (it reads `self.device_mesh`), None: the strategy plans in `setup`.
    """
    if any(True for _ in model.parameters()) or not builds_in_configure_model(model):
        return model
    try:
        # The attached Trainer (loggers, dataloaders, the strategy) is shared, not copied.
        trainer = getattr(model, "_trainer", None)
        probe = copy.deepcopy(model, memo={id(trainer): trainer} if trainer is not None else None)
        with torch.device("meta"):
            probe.configure_model()
    except Exception as error:  # the hook needs the process group; `setup` plans the real model
        log.debug("configure_model could not run before the processes start (%s); planning in setup", error)
        return None
    if not any(True for _ in probe.parameters()):
        return None
    check_initialisable(probe)
    return probe


def already_parallel(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )
