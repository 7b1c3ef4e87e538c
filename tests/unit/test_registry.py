"""`strategy="nd"` and the Hydra `parallel` groups build the strategy a user expects."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Trainer

import lightning_nd  # noqa: F401  (registers "nd")
from examples.lit import CausalLM
from lightning_nd import NDParallel
from lightning_nd.mesh.dims import DIM_NAMES, MESH_DIMS
from lightning_nd.planner.dry_run import plan_for, read_layout_arguments
from tests.models import build

CONF = Path(__file__).resolve().parents[2] / "conf" / "parallel"
WORLDS = {"single": 1, "4d": 16, "5d": 32}


def test_strategy_string_nd_is_fsdp_over_every_device():
    # Trainer construction only: fit is never called, so nothing is launched or spawned.
    trainer = Trainer(accelerator="cpu", devices=4, strategy="nd", logger=False, enable_progress_bar=False)  # no spawn
    assert isinstance(trainer.strategy, NDParallel)
    assert trainer.strategy.dims.dp_shard == 4 and trainer.strategy.dims.tp == 1


@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_parallel_config_builds_a_valid_layout(path):
    """On 4 devices, or the world its comment names (single: 1, 4d: 16, 5d: 32); ``search`` is no layout: it asks
    the planner for them (tests/unit/test_shortlist.py)."""
    options = yaml.safe_load(path.read_text())
    if path.stem == "search":
        assert set(options) == {"search"} and options["search"]["enabled"] and options["search"]["budget"] >= 1
        return
    if "parallel" in options:  # a `# @package _global_` file (single) also sets trainer options
        options = options["parallel"]
    devices = WORLDS.get(path.stem, 4)
    trainer = Trainer(accelerator="cpu", devices=devices,  # construction only, no spawn
                      strategy=NDParallel.from_config(options), logger=False, enable_progress_bar=False)
    strategy = trainer.strategy
    dims = strategy.dims.as_dict()
    assert dims["world_size"] == devices
    for key, value in options.items():
        if key in DIM_NAMES and value != -1:
            assert dims[key] == value, key
        elif key not in DIM_NAMES:
            assert getattr(strategy.config, key) == value, key
    fills = [key for key, value in options.items() if value == -1]
    assert all(dims[key] == devices // math.prod(v for k, v in dims.items() if k in MESH_DIMS and k != key)
               for key in fills)
    model = build("moe_llama" if options.get("ep", 1) > 1 else "llama" if options.get("tp", 1) != 1 else "llama8")
    layout = plan_for(read_layout_arguments(options), devices, CausalLM(model=model))  # plans as a run would
    assert {key: layout.options.to_dict()[key] for key in options if key not in DIM_NAMES} == {
        key: value for key, value in options.items() if key not in DIM_NAMES}
