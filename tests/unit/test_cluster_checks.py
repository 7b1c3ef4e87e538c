"""The launch traps of a cluster (`lightning_nd/strategy/cluster_checks.py`) refused when the Trainer is built,
before any process: with the environment SLURM (sbatch, srun) and torchrun really set, Lightning's own detection of
the cluster, and nothing launched."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer

from lightning_nd import NDParallel
from lightning_nd.strategy.cluster_checks import check_launch

SRUN_TASK = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "train",
             "SLURM_JOB_ID": "17", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
             "SLURM_STEP_ID": "0", "SLURM_NODELIST": "node[1-2]"}
"""What srun sets in task 0 of `sbatch --nodes=2 --ntasks-per-node=2` (the variables Lightning reads)."""


def _build(monkeypatch, env: dict[str, str], devices: int = 2, num_nodes: int = 2) -> Trainer:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=NDParallel(), logger=False,
                   enable_progress_bar=False)


def test_a_well_formed_srun_task_builds(monkeypatch):
    trainer = _build(monkeypatch, SRUN_TASK)
    assert type(trainer.strategy.cluster_environment).__name__ == "SLURMEnvironment"
    assert trainer.strategy.dims.world_size == 4


@pytest.mark.parametrize("change, devices, num_nodes, message", [
    ({"SLURM_NTASKS_PER_NODE": "4"}, 2, 2, "--ntasks-per-node=2`, or `devices=4`"),
    ({"SLURM_NNODES": "1", "SLURM_NTASKS": "2"}, 2, 2, "`#SBATCH --nodes=2`, or `num_nodes=1`"),
    ({"SLURM_STEP_ID": None}, 2, 2, "start it with `srun python ...`"),
])
def test_a_mismatch_with_slurm_is_refused_before_any_process(monkeypatch, change, devices, num_nodes, message):
    env = {**SRUN_TASK, **{k: v for k, v in change.items() if v is not None}}
    for name in (k for k, v in change.items() if v is None):
        env.pop(name)
    with pytest.raises(ValueError, match="HINT") as refused:
        _build(monkeypatch, env, devices, num_nodes)
    assert message in str(refused.value)


def test_torchrun_taken_for_slurm_is_refused_and_lightnings_own_choice_passes(monkeypatch):
    class SLURMEnvironment:  # what a Lightning that asks SLURM first (before 2.6) chooses
        pass

    elastic = {**SRUN_TASK, "TORCHELASTIC_RUN_ID": "nodes", "TORCHELASTIC_RESTART_COUNT": "0"}
    with pytest.raises(ValueError, match=r"plugins=\[TorchElasticEnvironment\(\)\]"):
        check_launch(SLURMEnvironment(), 2, 2, elastic)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    trainer = _build(monkeypatch, elastic)  # this Lightning asks torchrun first: nothing to refuse
    assert type(trainer.strategy.cluster_environment).__name__ == "TorchElasticEnvironment"


def test_slurms_repeated_count_form_and_no_slurm_at_all():
    class SLURMEnvironment:
        pass

    check_launch(SLURMEnvironment(), 2, 2, {**SRUN_TASK, "SLURM_NTASKS_PER_NODE": "2(x2)"})
    check_launch(object(), 8, 4, {})  # not SLURM: nothing to check
