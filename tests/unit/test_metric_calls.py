"""A step's torchmetrics calls under pp (`pipeline_parallel/metric_calls.py`), in one process: recorded microbatch by
microbatch, joined into the batch's and replayed, they leave a metric as one call with the whole batch leaves it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from lightning_nd.pipeline_parallel.metric_calls import MetricCalls, replay_calls

CLASSES = 3


class Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.acc = MulticlassAccuracy(num_classes=CLASSES, average="macro")
        self.scores = MetricCollection({"f1": MulticlassF1Score(num_classes=CLASSES, average="macro")})
        self.mean = MeanMetric()


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(6, CLASSES, generator=generator), torch.randint(0, CLASSES, (6,), generator=generator)


def test_recorded_microbatches_replayed_equal_one_call_with_the_batch():
    preds, target = _batch()
    recorder, module, one = MetricCalls(), Module(), Module()
    returned = []
    for part_preds, part_target in zip(preds.chunk(3), target.chunk(3)):
        with recorder.recording(module):
            returned.append(module.acc(part_preds, part_target))  # the microbatch's value, the metric untouched
            module.scores.update(part_preds, part_target)
    fresh = MulticlassAccuracy(num_classes=CLASSES, average="macro")
    assert torch.equal(returned[1], fresh(preds.chunk(3)[1], target.chunk(3)[1]))
    assert module.acc.update_count == 0 and "forward" not in vars(module.acc)
    calls = recorder.joined("Module.training_step")
    assert [(call.metric, call.method) for call in calls] == [("acc", "forward"), ("scores", "update")]
    replay_calls(recorder.of(module), calls, torch.device("cpu"))
    value = one.acc(preds, target)
    one.scores.update(preds, target)
    assert torch.equal(module.acc._forward_cache, value)  # what Lightning logs on_step for a logged metric
    assert torch.equal(module.acc.compute(), one.acc.compute())
    assert torch.equal(module.scores.compute()["f1"], one.scores.compute()["f1"])


def test_a_scalar_that_differs_between_microbatches_is_refused_naming_the_fix():
    recorder, module = MetricCalls(), Module()
    for loss in (1.0, 2.0):
        with recorder.recording(module):
            module.mean(torch.tensor(loss))
    with pytest.raises(ValueError, match=r"`Module.training_step` called `mean.forward` with a value the microbatches"
                                         r" cannot join, its argument 1: a Tensor that differs between microbatches"
                                         r" \(1, 2\).*HINT: pass the metric per-sample values"):
        recorder.joined("Module.training_step")


def test_microbatches_calling_other_metrics_are_refused():
    recorder, module = MetricCalls(), Module()
    preds, target = _batch()
    with recorder.recording(module):
        module.acc.update(preds[:3], target[:3])
    with recorder.recording(module):
        module.scores.update(preds[3:], target[3:])
    with pytest.raises(ValueError, match=r"acc.update against scores.update.*HINT"):
        recorder.joined("Module.validation_step")


def test_capturing_the_inputs_changes_no_metric():
    recorder, module = MetricCalls(), Module()
    with recorder.discarding(module):
        module.acc(*_batch())
        module.mean.update(torch.tensor(3.0))
    assert module.acc.update_count == 0 and module.mean.update_count == 0
    assert recorder.joined("Module.training_step") == []
