"""Every bad configuration fails before any process group exists, with the bad value and a HINT; the dry run
(``python -m lightning_nd.plan``) fails on it the same way, with the same type and message.

Each case (`error_cases.py`) is built exactly as a user would: `NDParallel.from_config(...)` (the constructor and
its keyword check), `Trainer(...)` (which validates the dims against devices without launching anything) and
`trainer.strategy.connect(module)` (the model checks `fit` would run first). `Trainer.fit` is never called. The
dry run gets the same case as command-line arguments and never builds the strategy.
"""

from __future__ import annotations

import ast
import json
import re

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

from examples.lit import CausalLM
from lightning_nd import NDParallel
from lightning_nd.layout.arguments import DIM_DEFAULTS
from lightning_nd.planner.__main__ import build_parser, main, run
from lightning_nd.planner.source import load_factory
from tests.models import build
from tests.unit.bad_models import MIXER_PLAN, LearnedPositions, MixerNet, ReversedMixer, batch_norm_net, moe
from tests.unit.error_cases import CASES, MODELS, Case


def _trainer(devices: int, strategy: NDParallel) -> Trainer:
    return Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


def _connect(devices: int, strategy: NDParallel, model: nn.Module) -> None:
    _trainer(devices, strategy).strategy.connect(CausalLM(model=model))


def through_trainer(case: Case) -> None:
    strategy = NDParallel.from_config(case.arguments)
    if case.devices is not None:
        trainer = _trainer(case.devices, strategy)
        if case.model is not None:
            trainer.strategy.connect(load_factory(case.model)())


def dry_run_argv(case: Case) -> list[str]:
    """The case as `python -m lightning_nd.plan` arguments: dims in ``--layout``, every other keyword in
    ``--options``; a case that fails in the constructor plans some model on some devices (never reached)."""
    sizes = {key: value for key, value in case.arguments.items() if key in DIM_DEFAULTS}
    options = {key: value for key, value in case.arguments.items() if key not in DIM_DEFAULTS}
    return ["--model", case.model or f"{MODELS}:llama", "--devices", str(case.devices or 4),
            "--layout", ",".join(f"{key}={json.dumps(value)}" for key, value in sizes.items()),
            "--options", json.dumps(options)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_configuration_raises_with_the_facts_and_a_hint(case):
    with pytest.raises(case.error) as raised:
        through_trainer(case)
    message = str(raised.value)
    for fact in [*case.facts, "HINT"]:
        assert fact in message, f"{fact!r} missing from: {message}"
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_dry_run_raises_the_same_error(case, monkeypatch, capsys):
    """The same type and message from the command line, which never builds `NDParallel`."""
    with pytest.raises(Exception) as through_strategy:
        through_trainer(case)

    def refuse(*args, **kwargs):
        raise AssertionError("the dry run built NDParallel")

    monkeypatch.setattr(NDParallel, "__init__", refuse)
    argv = dry_run_argv(case)
    with pytest.raises(Exception) as through_dry_run:
        run(build_parser().parse_args(argv))
    assert type(through_dry_run.value) is type(through_strategy.value)
    assert str(through_dry_run.value) == str(through_strategy.value)
    assert main(argv) == 2
    assert capsys.readouterr().err == f"error: {through_strategy.value}\n"


def test_the_same_setups_with_good_values_connect():
    """The model cases above fail for the stated reason, not because connect fails without a process group."""
    _connect(2, NDParallel(tp=2), build("llama"))
    _connect(4, NDParallel(tp=4), build("llama"))
    _connect(2, NDParallel(tp=2, block_classes=["DecoderLayer"]), build("llama"))
    _connect(4, NDParallel(tp=4, tp_plan=MIXER_PLAN), MixerNet(16, 12))
    _connect(2, NDParallel(pp=2, dp_shard=1), build("llama"))
    _connect(2, NDParallel(pp=-1, dp_shard=1, pp_layers_per_stage=[1, 1]), build("llama"))
    _connect(2, NDParallel(pp=2, dp_shard=1, pp_split=["layers.1"]), build("llama"))
    _connect(4, NDParallel(ep=4, dp_shard=4), moe(8))
    _connect(2, NDParallel(ep=2, dp_shard=2), build("hf_mixtral"))
    _connect(2, NDParallel(tp=2, tp_plan=MIXER_PLAN), batch_norm_net())  # tp alone gives BatchNorm the whole batch
    _connect(2, NDParallel(dp_shard=2), batch_norm_net(nn.SyncBatchNorm))
    _connect(2, NDParallel(dp_shard=2), LearnedPositions())
    _connect(2, NDParallel(cp=2, dp_shard=1), build("gpt"))  # learned positions, taken from `position_ids`
    assert not torch.distributed.is_initialized()


def test_the_suggested_plan_can_be_copied():
    with pytest.raises(ValueError) as raised:
        _connect(2, NDParallel(tp=2), MixerNet(block=ReversedMixer))
    suggested = ast.literal_eval(re.search(r"tp_plan=(\{.*?\})", str(raised.value)).group(1))
    trainer = _trainer(2, NDParallel(tp=2, tp_plan=suggested))
    trainer.strategy.connect(CausalLM(model=MixerNet(block=ReversedMixer)))
    assert not torch.distributed.is_initialized()
