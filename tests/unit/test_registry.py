"""`strategy="nd"` and the Hydra `parallel` groups build the strategy a user expects."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Trainer

import lightning_nd  # noqa: F401  (registers "nd")
from lightning_nd import NDParallel

CONF = Path(__file__).resolve().parents[2] / "conf" / "parallel"


def test_strategy_string_nd_is_fsdp_over_every_device():
    # Trainer construction only: fit is never called, so nothing is launched or spawned.
    trainer = Trainer(accelerator="cpu", devices=4, strategy="nd", logger=False, enable_progress_bar=False)  # no spawn
    assert isinstance(trainer.strategy, NDParallel)
    assert trainer.strategy.dims.dp_shard == 4 and trainer.strategy.dims.tp == 1


@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_parallel_config_builds_a_valid_layout_on_4_devices(path):
    options = yaml.safe_load(path.read_text())
    if "parallel" in options:  # a `# @package _global_` file (single) also sets trainer options
        options = options["parallel"]
    trainer = Trainer(accelerator="cpu", devices=4 if path.stem != "single" else 1,  # construction only, no spawn
                      strategy=NDParallel.from_config(options), logger=False, enable_progress_bar=False)
    assert trainer.strategy.dims.world_size == (1 if path.stem == "single" else 4)
