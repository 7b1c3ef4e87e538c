"""`conf/` as typed configs (examples/schema.py): every option of every group composes against its schema, a typo
or a wrong type fails at composition with Hydra's message naming the key (on the command line and in a group file
of the user's own), and the schemas mirror what they build, so an argument added there cannot be missed here."""

from __future__ import annotations

import dataclasses
import inspect
import shutil

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from examples.schema import CONF, SET_BY_THE_JOB, compose, plain_type, schemas
from lightning_nd import NDParallel

GROUPS = {group.name: sorted(p.stem for p in group.glob("*.yaml")) for group in CONF.iterdir() if group.is_dir()}


def _said(raised) -> str:
    """Hydra's message: the composition error's own and its cause's."""
    return f"{raised.value}\n{raised.value.__cause__}"


@pytest.mark.parametrize("group, option", [(g, o) for g, options in GROUPS.items() for o in options])
def test_every_option_of_every_group_composes_and_builds(group, option):
    cfg = compose([f"{group}={option}"])
    if group == "parallel":
        NDParallel.from_config(OmegaConf.to_container(cfg.parallel, resolve=True))
    if group == "diagnostics":
        assert cfg.diagnostics.enabled == (option != "off")


@pytest.mark.parametrize("override, key, message", [
    ("parallel.tp_sise=2", "parallel.tp_sise", "Key 'tp_sise' not in 'ParallelSchema'"),
    ("parallel.tp=two", "parallel.tp", "Value 'two' of type 'str' could not be converted to Integer"),
    ("trainer.max_step=3", "trainer.max_step", "Key 'max_step' not in 'TrainerSchema'"),
    ("diagnostics.routng=false", "diagnostics.routng", "Key 'routng' not in 'DiagnosticsSchema'"),
    ("model.hidden_size=3", None, None),  # llama has it
])
def test_a_typo_or_a_wrong_type_fails_at_composition_naming_the_key(override, key, message):
    if key is None:
        assert compose([override]).model.hidden_size == 3
        with pytest.raises(ConfigCompositionException) as raised:
            compose(["model=gpt", override])
        assert "Key 'hidden_size' not in 'GPTSchema'" in _said(raised)
        return
    with pytest.raises(ConfigCompositionException) as raised:
        compose([override])
    assert message in _said(raised) and f"full_key: {key}" in _said(raised)


def test_a_typo_in_a_group_file_of_ones_own_fails_naming_it(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "parallel" / "mine.yaml").write_text("dp_shard: -1\ntp: 2\nsequence_paralel: true\n")
    with pytest.raises(ConfigCompositionException) as raised:
        compose(["parallel=mine"], conf)
    assert "Key 'sequence_paralel' not in 'ParallelSchema'" in _said(raised)
    assert "In 'parallel/mine'" in _said(raised)  # the file it came from


def test_the_schemas_mirror_what_they_build():
    from lightning.pytorch import Trainer

    from examples.models.llama import LlamaConfig

    found = {group: {f.name: f for f in dataclasses.fields(schema)} for group, schema in schemas().items()}
    assert set(found["parallel"]) == set(inspect.signature(NDParallel.__init__).parameters) - {"self"}
    trainer = set(inspect.signature(Trainer.__init__).parameters) - {"self", *SET_BY_THE_JOB}
    assert set(found["trainer"]) == trainer
    assert set(found["llama_schema"]) == {"name"} | {f.name for f in dataclasses.fields(LlamaConfig)}
    defaults = inspect.signature(NDParallel.__init__).parameters
    assert found["parallel"]["timeout"].default == defaults["timeout"].default.total_seconds()
    assert found["parallel"]["dp_shard"].default == -1 and found["parallel"]["pp_schedule"].default == "1f1b"


def test_plain_types():
    from collections.abc import Mapping, Sequence
    from datetime import timedelta
    from typing import Any, Literal, Optional

    assert plain_type(Literal[1, 2, 3] | None) == Optional[int]  # noqa: UP045
    assert plain_type(Literal["none", "full"]) is str
    assert plain_type(timedelta | float | None) == Optional[float]  # noqa: UP045
    assert plain_type(bool | str) is Any
    assert plain_type(Sequence[int] | None) == Optional[list[int]]  # noqa: UP045
    assert plain_type(Mapping[str, object]) == dict[str, Any]


@pytest.mark.parametrize("option, model, world", [("4d", "llama", 16), ("5d", "moe", 32), ("3d", "llama", 8)])
def test_the_many_dim_layouts_plan_for_the_world_they_name(option, model, world):
    """The dry run (every check a run makes before its first batch) of the example model at the world size the
    option's comment names."""
    import torch

    from examples.train import model_factory
    from lightning_nd.mesh.dims import DIM_NAMES
    from lightning_nd.planner.dry_run import dry_run
    from lightning_nd.planner.source import Holder

    cfg = compose([f"parallel={option}", f"model={model}", f"trainer.devices={world}"])
    with torch.device("meta"):
        built = model_factory(cfg.model)()
    options = OmegaConf.to_container(cfg.parallel, resolve=True)
    sizes = {d: options.pop(d) for d in DIM_NAMES}
    layout = dry_run(Holder(built), world, sizes, options, seq_len=cfg.data.seq_len, micro_batch=cfg.data.batch_size)
    assert layout.dims["world_size"] == world and all(layout.dims[d] == 2 for d in ("pp", "dp_shard", "tp"))


def test_the_slurm_launcher_submits_one_task_per_device():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason='the SLURM launcher is an optional extra: pip install "lightning-nd[slurm]"')
    cfg = compose(["hydra/launcher=slurm", "trainer.devices=8", "trainer.num_nodes=2"], return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"].endswith("SlurmLauncher")
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (2, 8, 8)
