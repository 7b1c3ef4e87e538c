"""`ParallelDims`: the sizes of every parallel dimension, validated before any process group exists.

Dims, outermost to innermost: ``pp, dp_replicate, dp_shard, cp, tp``. Innermost dims get
neighbouring ranks so they stay inside one node (bandwidth priority TP > CP > EP > PP > DP).
``ep`` adds no ranks: it borrows them from ``dp_shard x cp``.
"""

from __future__ import annotations

import difflib
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DIM_NAMES = (*MESH_DIMS, "ep")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def closest_name(name: object, valid: Sequence[str]) -> str:
    """The valid name most like ``name``, for "did you mean" hints."""
    return difflib.get_close_matches(str(name), list(valid), n=1, cutoff=0.0)[0]


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel dimensions of one run.

    One mesh dim may be -1: it fills whatever ``world_size`` leaves after the others (``dp_shard``
    by default, so ``ParallelDims(tp=2, world_size=8)`` is dp_shard=4 x tp=2).
    """

    dp_replicate: int = 1
    """Full model replicas (DDP / the replicate dim of HSDP). Costs one gradient all-reduce per step."""
    dp_shard: int = -1
    """Ranks that shard parameters, gradients and optimizer state (FSDP / ZeRO). -1 fills the rest."""
    cp: int = 1
    """Context parallel: splits the sequence; K/V travel around a ring."""
    tp: int = 1
    """Tensor parallel: splits every weight matrix; two activation collectives per block."""
    pp: int = 1
    """Pipeline parallel: splits the layers into stages; point-to-point sends, plus a bubble."""
    ep: int = 1
    """Expert parallel: splits MoE experts over ranks borrowed from ``dp_shard x cp``."""
    world_size: int = 1

    @staticmethod
    def check_sizes(sizes: Mapping[str, Any]) -> None:
        """Each size alone: an int >= 1, or -1 ('fill the rest') for a mesh dim. Needs no world size."""
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(
                    f"`{name}={value!r}` must be an int, got {type(value).__name__}. HINT: write `{name}=2`, not 2.0 or '2'."
                )
            if value < 1 and not (value == -1 and name in MESH_DIMS):
                fill = "; -1 fills the rest of the world size" if name in MESH_DIMS else " (it borrows ranks, so it cannot be -1)"
                raise ValueError(f"`{name}={value}` must be >= 1{fill}. HINT: use `{name}=1` to switch it off.")

    def __post_init__(self) -> None:
        self.check_sizes({name: getattr(self, name) for name in DIM_NAMES})
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"`world_size={self.world_size!r}` must be a positive int.")
        filling = [name for name in MESH_DIMS if getattr(self, name) == -1]
        if len(filling) > 1:
            raise ValueError(
                f"Only one dim may be -1 ('fill the rest'), but {filling} are."
                f" HINT: give all but one a size, e.g. `dp_shard=1` when `{filling[-1]}=-1`."
            )
        if filling:
            fill = filling[0]
            others = math.prod(getattr(self, name) for name in MESH_DIMS if name != fill)
            if self.world_size % others:
                raise ValueError(
                    f"The other dims multiply to {others}, which does not divide world_size={self.world_size},"
                    f" so `{fill}=-1` cannot fill the rest. HINT: choose dims whose product divides"
                    f" {self.world_size} (divisors: {divisors(self.world_size)})."
                )
            object.__setattr__(self, fill, self.world_size // others)
        product = math.prod(self.shape)
        if product != self.world_size:
            raise ValueError(
                f"pp*dp_replicate*dp_shard*cp*tp = {self.pp}*{self.dp_replicate}*{self.dp_shard}*{self.cp}*{self.tp}"
                f" = {product}, but the run has world_size={self.world_size} processes."
                f" HINT: make the product {self.world_size} (e.g. `dp_shard=-1` fills the rest),"
                f" or run on {product} devices."
            )
        fsdp_size = self.dp_shard * self.cp
        if fsdp_size % self.ep:
            valid = [d for d in divisors(fsdp_size) if d % self.cp == 0]
            raise ValueError(
                f"`ep={self.ep}` must divide dp_shard*cp = {fsdp_size}: expert parallelism borrows its ranks"
                f" from dp_shard x cp. HINT: choose ep from {valid}."
            )
        if self.ep > 1 and self.ep % self.cp:
            valid = [d for d in divisors(fsdp_size) if d % self.cp == 0]
            raise ValueError(
                f"`ep={self.ep}` must be a multiple of cp={self.cp}: an expert group takes whole context-parallel"
                f" groups. HINT: choose ep from {valid}."
            )

    @classmethod
    def from_mapping(cls, sizes: Mapping[str, Any], world_size: int) -> ParallelDims:
        """Build from a mapping such as a Hydra config; unknown names raise with the closest valid one."""
        cls.check_names(sizes)
        return cls(**dict(sizes), world_size=world_size)

    @staticmethod
    def check_names(names: Sequence[str] | Mapping[str, Any]) -> None:
        """Every name is a dim; an unknown one names the closest."""
        for name in names:
            if name not in DIM_NAMES:
                raise ValueError(
                    f"Unknown parallel dim `{name}`. HINT: did you mean `{closest_name(name, DIM_NAMES)}`?"
                    f" Valid dims: {', '.join(DIM_NAMES)}."
                )

    # ---- which techniques are on -------------------------------------------------------------

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_shard_in_ep(self) -> int:
        """The inner part of dp_shard an ep group takes (with all of cp): ep // cp; 1 without ep."""
        return self.ep // self.cp if self.ep > 1 else 1

    @property
    def expert_dp(self) -> int:
        """How many ranks hold the same experts (and see different tokens): dp_replicate x dp_shard x cp / ep."""
        return self.dp_replicate * self.dp_shard * self.cp // self.ep

    @property
    def batch_size_multiplier(self) -> int:
        """How many ranks see different samples: the per-rank batch times this is the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIMS)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # ---- rank layout (pure arithmetic, no process group) ---------------------------------------

    def coordinates(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank, e.g. ``{"pp": 0, "dp_replicate": 0, "dp_shard": 1, ...}``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside world_size={self.world_size}.")
        coords = {}
        for name, size in zip(reversed(MESH_DIMS), reversed(self.shape)):
            coords[name] = rank % size
            rank //= size
        coords = {name: coords[name] for name in MESH_DIMS}
        coords["ep"] = (coords["dp_shard"] * self.cp + coords["cp"]) % self.ep
        return coords

    def rank_table(self) -> str:
        """A markdown table: one row per rank with its coordinate on every dim."""
        header = "| rank | " + " | ".join(DIM_NAMES) + " |"
        rule = "|" + "---|" * (len(DIM_NAMES) + 1)
        rows = [
            f"| {rank} | " + " | ".join(str(c) for c in self.coordinates(rank).values()) + " |"
            for rank in range(self.world_size)
        ]
        return "\n".join([header, rule, *rows])

    def check_topology(self, local_world_size: int | None) -> list[str]:
        """Warn when a TP, CP or EP group spans nodes; returns the warnings it issued."""
        if not local_world_size or local_world_size >= self.world_size:
            return []
        messages = []
        span = 1
        for name, size in (("tp", self.tp), ("cp", self.cp)):
            span *= size
            if size > 1 and (span > local_world_size or local_world_size % span):
                messages.append(self._spanning_message(name, size, span, local_world_size))
        if self.ep > 1 and self.ep * self.tp > local_world_size:
            messages.append(self._spanning_message("ep", self.ep, self.ep * self.tp, local_world_size))
        for message in messages:
            warnings.warn(message, stacklevel=2)
        return messages

    def _spanning_message(self, name: str, size: int, span: int, local_world_size: int) -> str:
        nodes = math.ceil(span / local_world_size)
        inner = [d for d in divisors(local_world_size) if d <= size]
        return (
            f"`{name}={size}` makes groups of {span} neighbouring ranks, which span {nodes} nodes of"
            f" {local_world_size} processes: its collectives cross the slow inter-node network every step."
            f" HINT: keep {name} inside a node ({name} in {inner}) and move the rest to dp_shard or pp,"
            f" which communicate less often."
        )
