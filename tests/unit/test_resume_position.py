"""Where a resumed run starts in its epoch, and the failure-handling knobs, without processes."""

from __future__ import annotations

import logging
from datetime import timedelta
from types import SimpleNamespace

import pytest
from lightning.pytorch.loops.progress import _ProcessedTracker
from torch.utils.data import DataLoader, DistributedSampler

from lightning_nd import NDParallel
from lightning_nd.data_position import DataPosition, SkippingLoader, resume_loader


def _trainer(epoch: int, batches: int) -> SimpleNamespace:
    progress = _ProcessedTracker(ready=batches, started=batches, processed=batches, completed=batches)
    return SimpleNamespace(current_epoch=epoch, fit_loop=SimpleNamespace(
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


@pytest.mark.parametrize("epoch,batches", [(1, 3), (0, 0), (0, 8)])
def test_no_skip_in_another_epoch_or_at_an_epoch_boundary(epoch, batches):
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
    assert (strategy._step_timeout, strategy._init_timeout, strategy._heartbeat_timeout) == (
        timedelta(seconds=30), timedelta(minutes=10), None)
    assert strategy._timeout == timedelta(minutes=10)  # the process group starts with the long one
