"""`check_layout`: every distinct rank of a layout sets up for real and runs one training step on fake tensors, in
this one CPU process (the ranks: `ranks.py`; the world they run in: `world.py`; the strategy as one of them sees it:
`strategy.py`). The first error is reported with its rank and the module it came from, as the cluster would have
raised it at its first step.
"""

from __future__ import annotations

import copy
import itertools
import logging
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader

from lightning_nd.check.causal import NextToken, vocabulary
from lightning_nd.check.ranks import pipelines_to_check
from lightning_nd.check.strategy import CheckedParallel, FakeCluster
from lightning_nd.check.values import CheckTensorMode, logging_outside_fake_tensors
from lightning_nd.check.world import FakeWorld, Hang, PeerFailed
from lightning_nd.context_parallel.region import regions_of_this_thread_only
from lightning_nd.layout.record import Layout
from lightning_nd.pipeline_parallel.stage import StageModule
from lightning_nd.runtime.errors import exception_chain, first_line

NOT_COMPUTABLE = ("DataDependentOutputException", "DynamicOutputShapeException", "GuardOnDataDependentSymNode")
"""Errors that mean the step needed a value a fake tensor does not have: that rank is not checked past it."""


@dataclass
class RankOutcome:
    rank: int
    coordinates: dict[str, int]
    seconds: float = 0.0
    status: str = "ok"
    """ok, failed (the step or setup raised), hang (waited for an object nobody sends), waited (its peer failed
    first), unchecked (the step needed a value computed from the weights) or nostep (fit ended without an optimizer
    step: the model's own dataloader gave no batch)."""
    error: str = ""
    module: str | None = None
    order: int = 0
    trace: str = ""


@dataclass
class CheckResult:
    world_size: int
    dims: dict[str, int]
    outcomes: list[RankOutcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def first_failure(self) -> RankOutcome | None:
        failed = [o for o in self.outcomes if o.status in ("failed", "hang")]
        return min(failed, key=lambda o: o.order) if failed else None

    @property
    def unchecked(self) -> list[RankOutcome]:
        return [o for o in self.outcomes if o.status in ("unchecked", "nostep")]

    @property
    def exit_code(self) -> int:
        """0 every rank stepped, 1 a rank failed, 3 no failure but a rank could not be checked to the end."""
        return 1 if self.first_failure is not None else 3 if self.unchecked else 0


def module_names(module: nn.Module) -> dict[int, tuple[str, type]]:
    """Each module of ``module`` by id: its name and class (fit may wrap it, pp copies it)."""
    return {id(sub): (name, type(sub)) for name, sub in module.named_modules()}


def failing_module(error: BaseException, names: Mapping[int, tuple[str, type]]) -> str | None:
    """Where the error came from: the innermost module of ``names`` on its traceback (any link of its chain), as
    ``name (Class)``, or the LightningModule's own method (``Class.training_step``) when no module inside it ran.
    A pipeline stage's modules (copies made by the split) are named as the originals of ``names``."""
    names = dict(names)
    for link in reversed(exception_chain(error)):
        found: str | None = None
        for frame, _ in traceback.walk_tb(link.__traceback__):
            owner = frame.f_locals.get("self")
            if isinstance(owner, StageModule) and id(owner.module) not in names:
                names.update(_stage_names(owner, names))
            if isinstance(owner, nn.Module) and id(owner) in names and (names[id(owner)][0] or _own_code(owner, frame)):
                name = names[id(owner)][0]
                found = f"{name} ({type(owner).__name__})" if name else f"{type(owner).__name__}.{frame.f_code.co_name}"
        if found is not None:
            return found
    return None


def _stage_names(stage: StageModule, names: Mapping[int, tuple[str, type]]) -> dict[int, tuple[str, type]]:
    """The stage's modules under the names their originals have: the split copies the model its units live in."""
    prefix = min((name for name, kind in names.values() if kind is type(stage.module)), key=len, default="")
    return {id(sub): (".".join(part for part in (prefix, name) if part), type(sub))
            for name, sub in stage.module.named_modules()}


def _own_code(module: nn.Module, frame: FrameType) -> bool:
    """Whether ``frame`` runs a method the user's LightningModule defines (not Lightning's, not the check's)."""
    function = getattr(type(module), frame.f_code.co_name, None)
    return getattr(function, "__code__", None) is frame.f_code and not function.__module__.startswith(  # type: ignore
        ("lightning.", "lightning_nd.", "torch."))


def _missing_key_hint(error: BaseException, lightning: Any) -> str:
    """Why a step may read a key the check's own batches lack, and what to do."""
    if not isinstance(error, KeyError) or type(lightning).train_dataloader is not LightningModule.train_dataloader:
        return ""
    return (f" (if {error} is a key of your batches: without a `train_dataloader` on the LightningModule the check"
            " makes its own, with 'input_ids' and 'labels' only. HINT: give the LightningModule a `train_dataloader`;"
            " the check runs one batch of it)")


def token_batches(model: nn.Module, seq_len: int, micro_batch: int, batch_ranks: int) -> DataLoader:
    """``micro_batch`` samples of ``seq_len`` random token ids per batch rank: one step's worth."""
    vocab = vocabulary(model)
    generator = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(vocab, (seq_len,), generator=generator),
                "labels": torch.randint(vocab, (seq_len,), generator=generator)}
               for _ in range(micro_batch * batch_ranks)]
    return DataLoader(samples, batch_size=micro_batch)


def check_layout(module: nn.Module, layout: Layout, arguments: Mapping[str, Any], *, precision: str | None = None,
                 gpus_per_node: int | None = None, seq_len: int = 1024, micro_batch: int | None = None,
                 progress: Callable[[str], None] | None = None) -> CheckResult:
    """Run the check. ``module``: the LightningModule (or the dry run's holder of a plain model, under ``model``),
    on the meta device, copied for each rank; ``layout``: the dry run's; ``arguments``: the `NDParallel` keywords."""
    world = len(layout.ranks)
    per_node = gpus_per_node or world
    batch = micro_batch or layout.options.pp_microbatches or 1
    pipelines = pipelines_to_check(layout)
    result = CheckResult(world, dict(layout.dims))
    outcomes = {rank: RankOutcome(rank, dict(layout.rank(rank).coordinates)) for ranks in pipelines for rank in ranks}
    result.outcomes = list(outcomes.values())
    failures = itertools.count(1)
    fake = FakeWorld(world)
    lock = threading.Lock()

    def one_rank(rank: int) -> None:
        outcome, start = outcomes[rank], time.perf_counter()
        names: dict[int, tuple[str, type]] = {}
        lightning: Any = module
        regions_of_this_thread_only()  # another rank's context-parallel region is not this rank's
        try:
            lightning = copy.deepcopy(module)
            loaded = not isinstance(lightning, LightningModule)
            if loaded:
                lightning = NextToken(lightning.model)
            names = module_names(lightning)
            strategy = CheckedParallel(CheckTensorMode(allow_non_fake_inputs=True), loaded, **arguments)
            trainer = Trainer(accelerator="cpu", devices=per_node, num_nodes=world // per_node,
                              plugins=[FakeCluster(rank, world, per_node)], precision=precision or "32-true",
                              strategy=strategy,
                              max_steps=1, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                              enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                              default_root_dir=root)
            own_loader = type(lightning).train_dataloader is not LightningModule.train_dataloader
            trainer.fit(lightning, None if own_loader else token_batches(
                getattr(lightning, "model", lightning), seq_len, batch, layout.dims["dp_replicate"]
                * layout.dims["dp_shard"]))
            if trainer.global_step != 1:
                with lock:
                    outcome.status, outcome.order = "nostep", next(failures)
                outcome.error = f"fit ended after {trainer.global_step} optimizer steps, not 1"
        except BaseException as error:  # kept in the outcome (the world ends the thread): the first one is shown
            chain = exception_chain(error)
            kinds = {type(link).__name__ for link in chain}
            outcome.status = ("hang" if any(isinstance(link, Hang) for link in chain) else
                              "waited" if any(isinstance(link, PeerFailed) for link in chain) else
                              "unchecked" if kinds & set(NOT_COMPUTABLE) else "failed")
            outcome.error = first_line(chain[-1]) + _missing_key_hint(chain[-1], lightning)
            outcome.module = None if outcome.status == "hang" else failing_module(error, names)
            outcome.trace = "".join(traceback.format_exception(error))
            with lock:
                outcome.order = next(failures)
            raise
        finally:
            outcome.seconds = time.perf_counter() - start - fake.waited[rank]
            if progress is not None:
                progress(f"rank {rank}: {outcome.status} in {outcome.seconds:.1f} s")

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lightning-nd-check-") as root, logging_outside_fake_tensors(), \
            warnings.catch_warnings(), quiet_lightning():
        warnings.simplefilter("ignore")
        fake.run(sorted(outcomes), one_rank)
    result.seconds = time.perf_counter() - start
    return result


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's per-Trainer info lines (GPU available, ...) for each checked rank are noise here."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
