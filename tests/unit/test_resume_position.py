"""Where a resumed run starts in its epoch, and the failure-handling knobs, without processes."""

from __future__ import annotations

import logging
from datetime import timedelta
from types import SimpleNamespace

import pytest
from lightning.pytorch.loops.progress import _ProcessedTracker
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from lightning_nd import NDParallel
from lightning_nd.strategy.data_position import DataPosition, SkippingLoader, resume_loader


def _trainer(epoch: int, batches: int, num_training_batches: float = 8) -> SimpleNamespace:
    progress = _ProcessedTracker(ready=batches, started=batches, processed=batches, completed=batches)
    return SimpleNamespace(current_epoch=epoch, num_training_batches=num_training_batches, fit_loop=SimpleNamespace(
        epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(current=progress))))


def _loader(batch_size: int, ranks: int = 2) -> DataLoader:
    sampler = DistributedSampler(range(64), num_replicas=ranks, rank=0, shuffle=True, seed=0)
    return DataLoader(range(64), batch_size=batch_size, sampler=sampler)


def test_same_global_batch_skips_the_batches_trained_then_runs_whole_epochs():
    loader, trainer = _loader(4), _trainer(epoch=0, batches=3)
    resumed = resume_loader(loader, DataPosition(0, 3, global_batch=8), batch_ranks=2, trainer=trainer)
    assert isinstance(resumed, SkippingLoader) and len(resumed) == len(loader) == 8
    assert [b.tolist() for b in resumed] == [b.tolist() for b in loader][3:]
    resumed.sampler.set_epoch(1)  # Lightning reaches the sampler through the wrapper
    assert loader.sampler.epoch == 1 and len(list(resumed)) == 8


def test_other_global_batch_says_how_far_off_it_is(caplog):
    loader, trainer = _loader(8), _trainer(epoch=0, batches=3)  # 16 samples per batch now, 8 before
    with caplog.at_level(logging.WARNING, logger="lightning_nd"):
        resumed = resume_loader(loader, DataPosition(0, 3, global_batch=8), batch_ranks=2, trainer=trainer)
    assert "cannot be preserved" in caplog.text and "skips 1 batches (16 samples) and 8 samples are trained twice" in caplog.text
    assert trainer.fit_loop.epoch_loop.batch_progress.current.completed == 1  # Lightning counts what this run skipped
    assert len(list(resumed)) == len(loader) - 1


def test_resuming_in_a_later_epoch_skips_in_that_epochs_order():
    """Lightning iterates the loader before it tells the sampler the epoch: the skip must not use epoch 0's order."""
    loader = _loader(4)
    resumed = resume_loader(loader, DataPosition(1, 2, global_batch=8), batch_ranks=2, trainer=_trainer(1, 2))
    got = [b.tolist() for b in resumed]
    expected_sampler = DistributedSampler(range(64), num_replicas=2, rank=0, shuffle=True, seed=0)
    expected_sampler.set_epoch(1)
    expected = [b.tolist() for b in DataLoader(range(64), batch_size=4, sampler=expected_sampler)]
    assert got == expected[2:] and expected[2:] != [b.tolist() for b in _loader(4)][2:]


def test_a_loader_without_length_is_skipped_by_reading():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(40))

    loader = DataLoader(Stream(), batch_size=4)
    position = DataPosition(0, 3, global_batch=8)
    resumed = resume_loader(loader, position, batch_ranks=2, trainer=_trainer(0, 3, num_training_batches=float("inf")))
    assert [b.tolist() for b in resumed][0] == [12, 13, 14, 15]


def test_position_of_a_finished_epoch_says_so():
    trainer = _trainer(0, 5, num_training_batches=5)  # limit_train_batches=5 of an 8-batch loader
    trainer.train_dataloader = _loader(4)
    position = DataPosition.of(trainer, batch_ranks=2)
    assert position == DataPosition(0, 5, 8, epoch_done=True)
    assert resume_loader(trainer.train_dataloader, position, 2, trainer) is trainer.train_dataloader


@pytest.mark.parametrize("epoch,batches", [(1, 3), (0, 0)])
def test_no_skip_in_another_epoch_or_at_its_start(epoch, batches):
    loader = _loader(4)
    assert resume_loader(loader, DataPosition(0, batches, 8), 2, _trainer(epoch, batches)) is loader


@pytest.mark.parametrize("knob,value,message", [
    ("timeout", timedelta(0), "`NDParallel(timeout=datetime.timedelta(0))` must be"),
    ("init_timeout", "10", "`NDParallel(init_timeout='10')` must be"),
    ("heartbeat_timeout", 1, "at least 2 s"),
])
def test_timeouts_are_checked_before_any_process_group(knob, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        NDParallel(**{knob: value})


def test_timeouts_accept_seconds_and_no_watchdog():
    strategy = NDParallel(timeout=30, init_timeout=600.0, heartbeat_timeout=None)
    failures = strategy.failures
    assert (failures.step_timeout, failures.init_timeout, failures.heartbeat_timeout) == (
        timedelta(seconds=30), timedelta(minutes=10), None)
    assert strategy._timeout == timedelta(minutes=10)  # the process group starts with the long one
