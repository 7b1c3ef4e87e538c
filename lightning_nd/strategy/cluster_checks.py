"""The launch traps of a cluster, refused when the Trainer is built (before any process or process group):

- SLURM's tasks per node (``--ntasks-per-node``) or node count (``--nodes``) not the Trainer's ``devices`` /
  ``num_nodes``: some ranks would never start, and the others wait for them until the timeout;
- torchrun inside a SLURM allocation taken for SLURM (Lightning before 2.6 asks SLURM first): every agent's
  processes would read SLURM's ranks, which describe the allocation, not torchrun's processes;
- a multi-process script started in the batch step itself, not under ``srun``: one process that waits for the
  others SLURM never started.

`check_launch` reads the environment it is given (the process's own by default), so it runs here on any machine.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

ELASTIC_VARIABLES = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
"""What torchrun (torch.distributed.run) sets in every process it starts."""
STEP_VARIABLES = ("SLURM_STEP_ID", "SLURM_STEPID")
"""What srun sets in every task of a job step; the batch script's own step does not have them."""


def _count(value: str) -> int | None:
    """``4``, or SLURM's ``4(x2)`` form: the leading number."""
    found = re.match(r"\s*(\d+)", value)
    return int(found.group(1)) if found else None


def check_launch(cluster_environment: object, devices: int, num_nodes: int,
                 environ: Mapping[str, str] | None = None) -> None:
    env = os.environ if environ is None else environ
    if type(cluster_environment).__name__ != "SLURMEnvironment":
        return
    if any(name in env for name in ELASTIC_VARIABLES):
        raise ValueError("This process was started by torchrun inside a SLURM allocation, and Lightning took its"
                         " ranks from SLURM, which describe the allocation, not torchrun's processes. HINT: pass"
                         " `plugins=[TorchElasticEnvironment()]` (lightning.pytorch.plugins.environments) to the"
                         " Trainer, or start the tasks with `srun` instead of torchrun.")
    per_node = _count(env.get("SLURM_NTASKS_PER_NODE", ""))
    if per_node is not None and per_node != devices:
        raise ValueError(f"SLURM starts {per_node} tasks per node (`--ntasks-per-node={per_node}`) but the Trainer"
                         f" has `devices={devices}`: a rank per device, each a task. HINT: `#SBATCH"
                         f" --ntasks-per-node={devices}`, or `devices={per_node}` (`trainer.devices={per_node}`).")
    nodes = _count(env.get("SLURM_NNODES", ""))
    if nodes is not None and nodes != num_nodes:
        raise ValueError(f"SLURM gave this job {nodes} nodes (`--nodes={nodes}`) but the Trainer has"
                         f" `num_nodes={num_nodes}`. HINT: `#SBATCH --nodes={num_nodes}`, or `num_nodes={nodes}`"
                         f" (`trainer.num_nodes={nodes}`).")
    if devices * num_nodes > 1 and not any(name in env for name in STEP_VARIABLES):
        raise ValueError("This script runs in the SLURM batch step itself, one process, while the Trainer expects"
                         f" {devices * num_nodes}: the others would never start. HINT: start it with `srun python"
                         " ...` inside the sbatch script (one task per device).")
