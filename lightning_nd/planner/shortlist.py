"""The layouts a measured search tries first: every valid layout of a model on ``devices`` ranks with the knobs the
field tunes first (ZeRO stage, microbatches under pp, recomputation: the least that fits), at one global batch,
costed by the planner; those predicted not to fit are dropped, the rest ordered by predicted step time, the best
variant of each set of dim sizes first (so the few measured runs are different layouts, not one layout's knobs).

Used by the example's ``parallel=search`` (`examples/search.py`), which measures the first ``budget`` of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_nd.cost.hardware import Hardware
from lightning_nd.cost.op_count import OpCount
from lightning_nd.cost.profile import HostProfile
from lightning_nd.cost.shape import model_shape
from lightning_nd.layout.plan import PlanMemo
from lightning_nd.layout.record import Layout
from lightning_nd.mesh.dims import divisors
from lightning_nd.planner.dry_run import dry_run
from lightning_nd.planner.search import Batching, Candidate, describe_sizes, search

ZERO_STAGES = (1, 2, 3)


@dataclass(frozen=True)
class Shortlist:
    firsts: tuple[Candidate, ...]
    """The best variant of each set of dim sizes that fits, by predicted step time."""
    rest: tuple[Candidate, ...]
    """The other fitting variants, by predicted step time."""
    dropped: tuple[Candidate, ...]
    """Predicted not to fit, even with full recomputation."""
    skipped: Counter
    """Enumerated sizes that are not valid layouts, by reason."""

    @property
    def ordered(self) -> tuple[Candidate, ...]:
        """What a search measures first: one variant per set of sizes, then the others."""
        return self.firsts + self.rest

    @property
    def planned(self) -> int:
        return len(self.ordered) + len(self.dropped)


def per_rank_batch(candidate: Candidate) -> int:
    """Samples one batch rank loads per optimizer step."""
    workload = candidate.workload
    return workload.batch * workload.accumulation


def _key(candidate: Candidate) -> tuple:
    sizes = candidate.sizes
    options = dict(candidate.options)
    if sizes["dp_shard"] == 1:
        options.pop("zero_stage", None)  # nothing is sharded: every stage is the same layout
    return describe_sizes(sizes), tuple(sorted(options.items())), per_rank_batch(candidate)


def shortlist(module: nn.Module, devices: int, gpus_per_node: int, memory_bytes: int, seq_len: int,
              global_batch: int, *, precision: str = "32-true", hardware: Hardware | None = None,
              optimizer: str = "adamw", options: dict[str, Any] | None = None,
              progress: Callable[[str], None] | None = None, profile: HostProfile | None = None,
              ops: OpCount | None = None) -> Shortlist:
    """``module``: the model on the meta device (a `Holder` or a LightningModule); one optimizer step is
    ``global_batch`` samples of ``seq_len`` tokens on every layout, without gradient accumulation outside pp (each
    batch rank loads ``global_batch / dp`` samples); under pp every microbatch count that divides it. ``profile``: a
    measured host pricing the steps instead of ``hardware`` (``ops``: the model's counted operations)."""
    memo = PlanMemo()
    shape = model_shape(module)
    fixed = options or {}

    def plan(sizes: dict[str, int], extra: dict[str, Any]) -> Layout:
        return dry_run(module, devices, sizes, {**extra, **fixed}, precision=precision, gpus_per_node=gpus_per_node,
                       memo=memo)

    found: dict[tuple, Candidate] = {}
    skipped: Counter = Counter()
    stages = (fixed["zero_stage"],) if "zero_stage" in fixed else ZERO_STAGES
    micro_batches = divisors(global_batch)
    for index, (zero, micro) in enumerate((z, m) for z in stages for m in micro_batches):
        if progress is not None:
            progress(f"planning variant {index + 1}/{len(stages) * len(micro_batches)}")
        result = search(plan, shape, devices, gpus_per_node, memory_bytes,
                        Batching(seq_len, global_batch, micro, precision), optimizer=optimizer, hardware=hardware,
                        options={**fixed, "zero_stage": zero}, profile=profile, ops=ops)
        skipped.update(result.skipped)
        for candidate in result.ranked:
            if candidate.sizes["pp"] == 1 and candidate.workload.accumulation != 1:
                continue  # outside pp a batch rank loads its whole share at once
            found.setdefault(_key(candidate), candidate)
    fitting = sorted((c for c in found.values() if c.fits), key=_predicted)
    dropped = tuple(c for c in found.values() if not c.fits)
    firsts: dict[str, Candidate] = {}
    for candidate in fitting:
        firsts.setdefault(describe_sizes(candidate.sizes), candidate)
    rest = tuple(c for c in fitting if all(c is not first for first in firsts.values()))
    return Shortlist(tuple(firsts.values()), rest, dropped, skipped)


def _predicted(candidate: Candidate) -> float:
    time = candidate.cost.time
    return time.total_s if time is not None else float("inf")
