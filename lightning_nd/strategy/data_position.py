"""Where in the data a checkpoint was saved, and resuming there.

Lightning restores its loop counters but restarts an ordinary ``DataLoader`` at the start of the epoch,
so a run resumed mid-epoch would train on the epoch's first batches twice and never see its last
ones. The training loader is wrapped to skip (read, not train) the batches already trained.

With Lightning's ``DistributedSampler``, step ``i`` of an epoch takes positions ``[i*G, (i+1)*G)`` of
one permutation of the dataset, for any number of batch ranks (``G`` = samples per step over all
batch ranks). So the same ``G`` resumes with the same samples per step, whatever the layout; another
``G`` cannot, and the log says how far off it is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from lightning.fabric.utilities.data import _set_sampler_epoch

log = logging.getLogger("lightning_nd")


@dataclass
class DataPosition:
    epoch: int
    batches: int  # batches of the epoch whose step ran
    global_batch: int | None  # samples per batch over all batch ranks (None: the loader has no batch_size)
    epoch_done: bool = False  # saved at the epoch's end (``limit_train_batches`` counts): the next one starts fresh

    @classmethod
    def of(cls, trainer: Any, batch_ranks: int) -> DataPosition:
        per_rank = getattr(trainer.train_dataloader, "batch_size", None)
        processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return cls(trainer.current_epoch, processed, per_rank * batch_ranks if per_rank else None,
                   epoch_done=processed >= trainer.num_training_batches)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DataPosition:
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class SkippingLoader:
    """A training loader whose next pass starts ``skip`` batches in; everything else is the loader's."""

    def __init__(self, loader: Any, skip: int) -> None:
        object.__setattr__(self, "loader", loader)
        object.__setattr__(self, "skip", skip)

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.loader)
        skip = self.skip
        object.__setattr__(self, "skip", 0)
        for done in range(skip):
            next(iterator)
            if (done + 1) % 1000 == 0:
                log.info(f"lightning-nd: skipped {done + 1}/{skip} batches already trained")
        return iterator

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: Any) -> None:  # e.g. Lightning's `worker_init_fn`
        setattr(self.loader, name, value)


def resume_loader(loader: Any, position: DataPosition | None, batch_ranks: int, trainer: Any, changed: str = "",
                  speak: bool = True) -> Any:
    """``loader`` for the epoch a run resumes in: skipping what ``position`` says was trained. ``changed``: how the
    layout changed since the save (said in one warning with the global batch, then and now); ``speak``: this rank
    says it (one rank does)."""
    warn = log.warning if speak else log.debug
    per_rank = getattr(loader, "batch_size", None)
    global_batch = per_rank * batch_ranks if per_rank else None
    then = position.global_batch if position is not None else None
    if changed:
        changed += (f" Global batch: {then} samples when saved, {global_batch} now ({batch_ranks} batch ranks x"
                    f" {per_rank}).")
    if (position is None or trainer.current_epoch != position.epoch or position.batches == 0 or position.epoch_done
            or (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)))):
        if changed:  # at an epoch's end the next epoch starts from its beginning; a stateful loader resumes itself
            warn(f"lightning-nd: {changed}")
        return loader
    # Lightning starts iterating before it tells the sampler the epoch: skipping now must use this epoch's order.
    _set_sampler_epoch(loader, position.epoch)
    skip = position.batches
    if global_batch is None or then is None:
        warn(f"lightning-nd: {changed + ' ' if changed else ''}Resuming epoch {position.epoch} after {skip}"
                    " batches; the loader has no `batch_size`, so the samples skipped are counted in batches, not"
                    " checked.")
    elif global_batch != then:
        seen = position.batches * then
        skip = seen // global_batch
        warn(
            f"lightning-nd: {changed + ' ' if changed else ''}The data order of epoch {position.epoch} cannot be"
            f" preserved. The checkpoint was saved after {position.batches} batches of {then} samples ({seen}"
            f" samples); this run takes {global_batch} samples per batch ({batch_ranks} batch ranks x {per_rank}), so"
            f" it skips {skip} batches ({skip * global_batch} samples) and {seen - skip * global_batch} samples are"
            " trained twice. Later epochs are as an uninterrupted run at this batch size. HINT: keep batch ranks x"
            f" batch_size at {then} to resume exactly."
        )
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        progress.ready = progress.started = progress.processed = progress.completed = skip
    elif changed:
        warn(f"lightning-nd: {changed}")
    log.info(f"lightning-nd: resuming epoch {position.epoch} at batch {skip}: skipping the {skip} batches already trained")
    return SkippingLoader(loader, skip)
