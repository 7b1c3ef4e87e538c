"""Which job this process belongs to, and which restart round of it: read from what the launcher sets.

torchrun keeps its rendezvous store across ``--max-restarts`` (and an elastic re-rendezvous), so keys one generation
wrote (a failure verdict, a monitor's captures) are still there for the next. Everything this project keeps in the
store is prefixed with `store_prefix`, which names the restart round: a restarted generation starts clean.

The run key names a job the same way in every rank and every restart of it (SLURM's job id, torchrun's run id), so
a restarted generation finds the first generation's folder and checkpoints; the time of day would not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

RESTART_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
"""torchrun's restart count (per agent, also after an elastic re-rendezvous), SLURM's count of requeues."""


def restart_round(environ: Mapping[str, str] = os.environ) -> str:
    """``"<torchrun restarts>.<SLURM requeues>"``: different in every generation of one job, the same on every rank of
    one generation (torchrun's agents restart their workers together; a requeued SLURM job starts all its tasks)."""
    return ".".join(environ.get(name, "0") or "0" for name in RESTART_VARIABLES)


def store_prefix(kind: str, environ: Mapping[str, str] = os.environ) -> str:
    """The prefix of ``kind``'s keys in the rendezvous store for this generation (``lightning_nd/<kind>/<round>/``)."""
    return f"lightning_nd/{kind}/{restart_round(environ)}/"


def run_key(environ: Mapping[str, str] = os.environ) -> str:
    """A folder name the same for every rank and every restart of one job: ``slurm-<job id>`` (a requeued job keeps
    its id), ``torchrun-<run id>`` (``--rdzv-id``; with the default id ``none``, the agent's process id on this host,
    which a restart keeps), else the time of day (a plain run: Lightning's own launcher hands its run folder to the
    processes it starts), taken once per process so that its own checkpoints stay its own."""
    global _STARTED
    if environ.get("SLURM_JOB_ID"):
        return f"slurm-{environ['SLURM_JOB_ID']}"
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun-{run_id}"
    if run_id:
        return f"torchrun-agent{os.getppid()}"
    _STARTED = _STARTED or time.strftime("%Y-%m-%d/%H-%M-%S")
    return _STARTED


_STARTED = ""
