"""`MetaBuild`: a model built in `configure_model` on the meta device, then materialised rank by rank as the model
plain construction gives (its ties, its own init), for `NDParallel`."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn

from lightning_nd.checkpoint.names import Names
from lightning_nd.layout.record import Layout
from lightning_nd.runtime.init_record import InitRecorder
from lightning_nd.runtime.materialize import materialize
from lightning_nd.runtime.model_init import ModelInit


class MetaBuild:
    def __init__(self, init_on_meta: bool) -> None:
        """``init_on_meta``: `configure_model` (and ``trainer.init_module()``) build on the meta device."""
        self.init_on_meta = init_on_meta
        self._records: list[InitRecorder] = []
        self._init = ModelInit()

    @contextmanager
    def context(self, empty_init: bool | None,
                precision: Callable[[], AbstractContextManager[object]]) -> Generator[None, None, None]:
        """Where tensors are made: on the meta device, recording what materialising must give again, or as is."""
        if not (self.init_on_meta if empty_init is None else empty_init):
            with precision():
                yield
            return
        recorder = InitRecorder()
        with recorder, torch.device("meta"), precision():
            yield
        self._records.append(recorder)

    def resolve(self, model: nn.Module) -> None:
        """What the builds recorded, in the names of ``model`` as built (before any technique changes it)."""
        for record in self._records:
            self._init += record.resolve(model)
        self._records.clear()

    def materialize(self, model: nn.Module, device: torch.device, broadcast: Callable[[int], int],
                    layout: Layout | None) -> None:
        """Every meta tensor becomes this rank's shard, initialised as the recorded builds initialised it, from one
        seed for all ranks (``broadcast``: rank 0's value of this process's)."""
        seed = broadcast(torch.initial_seed() % 2**31)
        init, self._init = self._init, ModelInit()
        pipeline = layout.pipeline if layout is not None else None
        names = Names(pipeline.attribute) if pipeline is not None else Names()
        materialize(model, device, seed=seed, init=init, original_name=names.original)
