"""What the strategy learns about the user's LightningModule before planning: the module to plan (a
`configure_model` built on a meta-device copy) and whether the user parallelized it already. These need
Lightning's notion of a module, so they live with the glue, not in `layout/`.
"""

from __future__ import annotations

import copy
import logging

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.tensor import DTensor

from lightning_nd.runtime.materialize import check_initialisable

log = logging.getLogger("lightning_nd")


def model_to_check(model: LightningModule) -> torch.nn.Module | None:
    """The module `plan_layout` plans before any process group exists.

    A model built in `configure_model` does not exist yet: build it on a meta-device copy. If that
    hook needs the running job (it reads `self.device_mesh`), None: the strategy plans in `setup`.
    """
    if any(True for _ in model.parameters()) or not is_overridden("configure_model", model):
        return model
    try:
        # The attached Trainer (loggers, dataloaders, the strategy) is shared, not copied.
        probe = copy.deepcopy(model, memo={id(model._trainer): model._trainer} if model._trainer else None)
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
