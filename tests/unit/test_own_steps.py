"""The pieces of running a module's own steps under pp, in one process: capture, microbatches, scoring, logs."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn

from lightning_nd.pipeline_parallel import own_steps
from lightning_nd.pipeline_parallel.metric_calls import MetricCalls, MetricRef


class Stepper(nn.Module):
    def __init__(self, calls: int = 1, log_metric: bool = False) -> None:
        super().__init__()
        self.model = nn.Linear(3, 2)
        self.calls, self.log_metric, self.before = calls, log_metric, []

    def log(self, name, value, **options):  # replaced by the sink while a step runs
        raise AssertionError("the step's own `log` must not run")

    def training_step(self, batch, batch_idx):
        self.before.append(batch_idx)
        self.log("seen", float(batch["x"].shape[0]), reduce_fx="sum")
        out = [self.model(batch["x"], scale=2) for _ in range(self.calls)][-1]
        if self.log_metric:
            self.log("metric", _Metric())
        loss = (out - batch["y"]).pow(2).mean()
        self.log("loss", loss)
        return {"loss": loss}


class _Metric:
    """Looks like a metric, but is not the module's: no other stage could log it."""

    def update(self) -> None: ...

    def compute(self) -> None: ...


def _run(module: nn.Module) -> own_steps.StepRun:
    return own_steps.StepRun(module, "model", module.training_step, MetricCalls())


def test_capture_records_the_model_call_and_stops_there():
    module = Stepper()
    batch = {"x": torch.randn(4, 3), "y": torch.randn(4, 2)}
    inputs = own_steps.capture(module, "model", module.training_step, (batch, 7))
    assert inputs.keys() == {"_arg0", "scale"} and inputs["_arg0"] is batch["x"] and inputs["scale"] == 2
    assert isinstance(module.model, nn.Linear) and "log" not in vars(module)  # restored
    assert module.before == [7]


def test_capture_of_a_step_without_model_call_is_none():
    module = Stepper()
    module.training_step = lambda batch, batch_idx: None
    assert own_steps.capture(module, "model", module.training_step, ({}, 0)) is None


def test_microbatches_split_every_batch_tensor_as_the_schedule_does():
    Pair = namedtuple("Pair", "x y")
    batch = {"x": torch.arange(10).view(5, 2), "meta": torch.zeros(3), "pair": Pair(torch.arange(5), "tag"), "n": 1}
    pieces = [own_steps.microbatch(batch, i, 2, 5) for i in range(2)]
    assert [p["x"].shape[0] for p in pieces] == [3, 2]  # torch.tensor_split: the first pieces are one longer
    assert torch.equal(torch.cat([p["x"] for p in pieces]), batch["x"])
    assert all(p["meta"] is batch["meta"] and p["n"] == 1 and p["pair"].y == "tag" for p in pieces)
    assert isinstance(pieces[1]["pair"], Pair) and pieces[1]["pair"].x.tolist() == [3, 4]


def test_scoring_answers_the_model_call_with_the_stage_output_and_combines_logs():
    module = Stepper()
    run = _run(module)
    batch = {"x": torch.randn(4, 3), "y": torch.zeros(4, 2)}
    losses = []
    for i in range(2):
        piece = own_steps.microbatch(batch, i, 2, 4)
        output = torch.full((2, 2), float(i + 1), requires_grad=True)
        run.logged.weight = 2.0
        result, asked = run.score((piece, 0), output)
        assert not asked
        losses.append(own_steps.step_loss(result, run.name))
    assert [loss.item() for loss in losses] == [1.0, 4.0]
    assert dict((name, value) for name, value, _ in run.logged.combined()) == {"seen": 4.0, "loss": 2.5}


def test_a_step_calling_the_model_twice_is_refused_with_both_fixes():
    module = Stepper(calls=2)
    with pytest.raises(ValueError, match=r"Stepper.training_step` called the model 2 times.*HINT.*pipeline_inputs"):
        _run(module).score(({"x": torch.randn(2, 3), "y": torch.zeros(2, 2)}, 0), torch.zeros(2, 2))


def test_a_logged_metric_of_the_module_is_kept_by_name_and_one_elsewhere_is_refused():
    from torchmetrics import SumMetric

    module = Stepper()
    module.total = SumMetric()
    logged = own_steps.Logged({id(module.total): "total"})
    logged("total", module.total, on_epoch=True)
    assert logged.combined() == [("total", MetricRef("total"), {"on_epoch": True})]
    module = Stepper(log_metric=True)
    with pytest.raises(ValueError, match=r"not an attribute of the LightningModule.*HINT: assign it"):
        _run(module).score(({"x": torch.randn(2, 3), "y": torch.zeros(2, 2)}, 0), torch.zeros(2, 2))


def test_an_error_on_the_last_stage_is_kept_for_every_rank_and_the_schedule_goes_on():
    run = _run(Stepper())
    assert run.guarded(lambda: own_steps.step_loss(None, run.name), lambda: "instead") == "instead"
    assert run.guarded(lambda: "later work", lambda: "instead") == "instead"  # one error is enough
    assert isinstance(run.error, ValueError) and "Stepper.training_step` returned NoneType" in str(run.error)


def test_reductions_and_a_step_without_loss():
    logged = own_steps.Logged()
    for value, weight in ((1.0, 3.0), (3.0, 1.0)):
        logged.weight = weight
        for fx in ("mean", "max", "min"):
            logged(fx, value, reduce_fx=fx)
        logged("torch_sum", value, reduce_fx=torch.sum)
    assert {n: v for n, v, _ in logged.combined()} == {"mean": 1.5, "max": 3.0, "min": 1.0, "torch_sum": 4.0}
    logged("odd", 1.0, reduce_fx="median")
    with pytest.raises(ValueError, match="'mean', 'sum', 'max' or 'min'"):
        logged.combined()
    with pytest.raises(ValueError, match="returned NoneType.*cannot be skipped"):
        own_steps.step_loss(None, "Stepper.training_step")
