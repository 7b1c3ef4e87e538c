"""`CheckedParallel`: `NDParallel` as one rank of a fake world (`world.py`) sees it.

Everything the strategy does runs as written (the mesh, the plan, tensor/context/expert parallel, FSDP, the pipeline
stages, the step), with four differences a fake world needs: the model's shards become fake tensors
(`FakeTensorMode`: no memory, no arithmetic; a model that comes with its weights is not initialised), and so does
everything the step computes from them; an object
broadcast from another rank reads as this rank's own (every rank computes the same ones: a seed, a log folder); a
decision taken over all ranks is this rank's; and the watchdog, which needs a real store, is off.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from torch._subclasses.fake_tensor import FakeTensorMode
from typing_extensions import override

from lightning_nd.runtime.ties import to_empty_keeping_ties
from lightning_nd.strategy.nd_parallel import NDParallel


class CheckedParallel(NDParallel):
    def __init__(self, fake_mode: FakeTensorMode, loaded: bool, **arguments: Any) -> None:
        """``loaded``: the model stands for one whose weights are loaded (a Hugging Face config, a plain module):
        its shards become fake tensors as they are, without the initialisation a `configure_model` model needs."""
        super().__init__(**{**arguments, "heartbeat_timeout": None})
        self.fake_mode, self.loaded = fake_mode, loaded

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    @override
    def _materialize(self, device: torch.device) -> None:
        with self.fake_mode:
            if self.loaded:
                assert self.model is not None
                to_empty_keeping_ties(self.model, device)
            else:
                super()._materialize(device)

    @override
    def model_to_device(self) -> None:
        """Nothing to move: `_materialize` made the shards on the root device. Moving them again would swap each
        fake parameter, which torch refuses for one its fake mode still remembers (Qwen3 under tp)."""

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.fake_mode:
            return super().training_step(*args, **kwargs)

    @override
    def backward(self, *args: Any, **kwargs: Any) -> Any:
        with self.fake_mode:
            return super().backward(*args, **kwargs)

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.fake_mode:
            return super().optimizer_step(*args, **kwargs)


class FakeCluster(ClusterEnvironment):
    """One rank of ``world_size`` processes, ``per_node`` on a node, started by someone else (no launch)."""

    def __init__(self, rank: int, world_size: int, per_node: int) -> None:
        super().__init__()
        self.rank, self.size, self.per_node = rank, world_size, per_node

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self.size

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return self.rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self.rank % self.per_node

    def node_rank(self) -> int:
        return self.rank // self.per_node
