"""SLURM's auto-requeue (`SLURMEnvironment(auto_requeue=True)`), with a sharded save every rank takes part in.

Lightning's handler of the requeue signal (SIGUSR1 by default, sent some time before the job's limit:
``#SBATCH --signal=USR1@90``) saves ``hpc_ckpt_<N>`` from inside the signal handler, wherever each process is then. A
sharded save is a collective, so ranks interrupted in different places (one inside an all-reduce, one in the data
loader) would deadlock or save a state no step ever had. Here the handler only notes the signal; at the start of every
training batch the ranks agree (one all-reduce of a flag: the previous step, its checkpoint callbacks included, is
done everywhere) and, once any has it, all save ``hpc_ckpt_<N>`` in ``default_root_dir``, rank 0 asks SLURM to
requeue the job (``scontrol requeue``), and the run stops. The requeued job resumes with ``ckpt_path="auto"``
(`auto_resume.py`), or ``ckpt_path=None``/``"hpc"`` as Lightning does.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from types import FrameType

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer

log = logging.getLogger("lightning_nd")


class Requeue:
    def __init__(self) -> None:
        self._signalled = self._armed = False

    def arm(self, trainer: Trainer) -> None:
        """Replace Lightning's requeue handler (it registered its own as the run started; it restores the old ones
        at the end)."""
        environment = trainer._accelerator_connector.cluster_environment
        self._signalled = self._armed = False
        if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue) or os.name == "nt":
            return
        assert environment.requeue_signal is not None
        signal.signal(environment.requeue_signal, self._note)
        self._armed = True

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = True

    def at_batch_start(self, trainer: Trainer, device: torch.device) -> None:
        """Every rank, before a training batch: save and requeue once any rank has the signal."""
        import torch.distributed as dist

        if not self._armed:
            return
        flag = torch.tensor([int(self._signalled)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        self._armed = False
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        if trainer.is_global_zero:
            log.warning(f"lightning-nd: the requeue signal came: saving `{path}` at step {trainer.global_step}, every"
                        " rank between the same two steps, then requeueing the job")
        for logger in trainer.loggers:
            logger.finalize("finished")
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            _requeue()
        trainer.should_stop = True
        _flush()  # SLURM ends the job soon: a log written through a pipe must not stay in a buffer


def _flush() -> None:
    for handler in [*logging.getLogger().handlers, *log.handlers]:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()


def _requeue() -> None:
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ["SLURM_JOB_ID"]
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if done.returncode == 0:
        log.warning(f"lightning-nd: requeued SLURM job {job}")
    else:
        log.warning(f"lightning-nd: `scontrol requeue {job}` failed ({done.returncode}: {done.stderr.strip()}); the"
                    f" checkpoint is saved: resubmit the job to resume from it")
