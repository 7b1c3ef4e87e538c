"""``examples/train.py`` under a real SLURM (a one-node cluster started here, `tests/e2e/slurm_cluster.py`): a 2-task
job started by ``srun`` inside ``sbatch`` trains through Lightning's SLURM environment, and the launch traps are
refused before any process group with their fix: a script run in the batch step without srun, and tasks per node
that are not the Trainer's devices. Skipped, saying why, where SLURM cannot be installed or started."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.slurm_cluster import cluster
from tests.e2e.test_train import REPO, events

TRAIN = [sys.executable, "examples/train.py", "parallel=fsdp", "trainer.max_steps=3", "trainer.limit_val_batches=0",
         "diagnostics=off"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with cluster(tmp_path_factory.mktemp("slurm")) as (environment, why):
        if environment is None:
            pytest.skip(f"the SLURM test needs a local SLURM (slurmctld, slurmd, munge): {why}")
        yield environment


def sbatch(environment: dict, folder: Path, command: list[str], tasks_per_node: int = 2) -> tuple[int, str]:
    """One job of ``tasks_per_node`` tasks on the one node, its script running ``command``; waits for it."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --ntasks-per-node={tasks_per_node}\n"
                      f"#SBATCH --output={folder / 'job.out'}\n" + " ".join(command) + "\n")
    done = subprocess.run(["sbatch", "--wait", f"--chdir={REPO}", str(script)], env=environment,
                          capture_output=True, text=True, timeout=600)
    output = (folder / "job.out").read_text() if (folder / "job.out").is_file() else ""
    return done.returncode, done.stdout + done.stderr + output


def test_a_two_task_job_trains_under_srun(slurm, tmp_path):
    code, output = sbatch(slurm, tmp_path, ["srun", *TRAIN, "trainer.devices=2", f"hydra.run.dir={tmp_path / 'run'}"])
    assert code == 0, output[-4000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in output  # SLURM's second task is rank 1
    assert len(events(tmp_path / "run" / "tensorboard").Scalars("train_loss")) == 3
    record = json.loads((tmp_path / "run" / "tensorboard" / "diagnostics" / "run.json").read_text())
    assert record["status"] == "ok" and record["dims"]["world_size"] == 2 and record["dims"]["dp_shard"] == 2


@pytest.mark.parametrize("command, message", [
    (TRAIN + ["trainer.devices=2"], "start it with `srun python ...` inside the sbatch script"),
    (["srun", *TRAIN, "trainer.devices=4"], "HINT: `#SBATCH --ntasks-per-node=4`, or `devices=2`"),
], ids=["no srun", "tasks per node"])
def test_a_launch_trap_is_refused_before_any_process_group(slurm, tmp_path, command, message):
    code, output = sbatch(slurm, tmp_path, [*command, f"hydra.run.dir={tmp_path / 'run'}"])
    assert code != 0 and message in output, output[-4000:]
    assert "Initializing distributed" not in output
