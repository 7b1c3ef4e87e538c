"""``examples/train.py`` under a real SLURM (a one-node cluster started here, `tests/e2e/slurm_cluster.py`): a 2-task
job started by ``srun`` inside ``sbatch`` trains through Lightning's SLURM environment, and the launch traps are
refused before any process group with their fix: a script run in the batch step without srun, and tasks per node
that are not the Trainer's devices. Skipped, saying why, where SLURM cannot be installed or started."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_nd.checkpoint import is_complete, read_sharded
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


def test_a_requeue_signal_saves_between_two_steps_and_the_requeued_job_resumes(slurm, tmp_path):
    """SIGUSR1 to the job's tasks (as ``#SBATCH --signal=USR1@90`` sends it): every rank saves ``hpc_ckpt_1`` between
    the same two steps, rank 0 requeues the job, and the requeued job (``ckpt_path=auto``) resumes from it."""
    run = tmp_path / "run"
    command = ["srun", sys.executable, "tests/e2e/faulty_train.py", *TRAIN[2:], "trainer.devices=2",
               "trainer.max_steps=40", "checkpoint.every_n_train_steps=1000", f"hydra.run.dir={run}"]
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n#SBATCH --requeue\n"
                      f"#SBATCH --open-mode=append\n#SBATCH --output={tmp_path / 'job.out'}\n" + " ".join(command) + "\n")
    submitted = subprocess.run(["sbatch", "--parsable", f"--chdir={REPO}", str(script)], env=slurm,
                               capture_output=True, text=True, check=True)
    job = submitted.stdout.strip().split(";")[0]
    losses = run / "losses.jsonl"
    state = wait_for(slurm, job, lambda: losses.is_file() and len(losses.read_text().splitlines()) >= 5)
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm, check=True)
    wait_for(slurm, job, lambda: False, until=("PENDING",))  # requeued: SLURM holds it back for a while, so
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm, check=True)  # release it
    state = wait_for(slurm, job, lambda: False, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    output = (tmp_path / "job.out").read_text()
    assert state == "COMPLETED", output[-6000:]
    saved = re.findall(r"the requeue signal came: saving `[^`]*hpc_ckpt_1\.ckpt` at step (\d+)", output)
    assert len(saved) == 1, output[-6000:]
    step = int(saved[0])
    assert is_complete(run / "hpc_ckpt_1.ckpt") and read_sharded(run / "hpc_ckpt_1.ckpt")["global_step"] == step
    # The batch that had started when the signal came runs to its end before the job stops, and the train-end save of
    # `last` may finish before SLURM ends the tasks: `auto` then takes that newer complete checkpoint, one step later.
    resumed = re.findall(r"`ckpt_path='auto'` resumes from `([^`]+)` \(step (\d+)[,)]", output)
    assert len(resumed) == 1, output[-6000:]
    path, start = resumed[0][0], int(resumed[0][1])
    assert (path, start) == (str(run / "hpc_ckpt_1.ckpt"), step) or (
        start == step + 1 and Path(path).parent == run / "checkpoints"), resumed
    rows = [json.loads(line) for line in losses.read_text().splitlines()]
    first = {step: loss for round_, step, loss in rows if round_ == "0.0"}
    again = {step: loss for round_, step, loss in rows if round_ == "0.1"}
    assert min(again) == start + 1 and max(again) == 40
    for overlap in set(first) & set(again):  # steps both rounds ran: the same loss
        assert again[overlap] == first[overlap], overlap


def wait_for(environment: dict, job: str, ready, until: tuple[str, ...] = (), timeout: float = 400) -> str:
    """Poll the job until ``ready()`` (while it runs) or it reaches a state in ``until``; its state then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", job], env=environment, capture_output=True, text=True).stdout
        state = (re.findall(r"JobState=(\w+)", shown) or ["?"])[0]
        if state in until or (state == "RUNNING" and ready()):
            return state
        time.sleep(1)
    raise AssertionError(f"job {job} still {state} after {timeout} s")
