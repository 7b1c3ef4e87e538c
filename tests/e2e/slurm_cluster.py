"""A one-node SLURM cluster on this machine for the SLURM tests: the distribution's ``slurm-wlm`` (installed with
apt-get where it can be, as root), munge for authentication, ``slurmctld`` and ``slurmd`` started with a
configuration in a temporary folder (``SLURM_CONF``), stopped on leaving. `start` returns None and why where it
cannot run."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from tests.launcher import free_port

CONF = """ClusterName=lightning_nd_test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
SlurmctldPort={port}
SlurmdPort={port_d}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/none
NodeName={host} CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _run(command: list[str], **options) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=900, **options)


def install() -> str:
    """"" when slurmctld, slurmd and munged are there (installed now if needed), else why not."""
    if all(shutil.which(name) for name in ("slurmctld", "slurmd", "sbatch", "munged")):
        return ""
    if not shutil.which("apt-get") or os.geteuid() != 0:
        return "no SLURM, and no apt-get run as root to install it (`apt-get install slurm-wlm`)"
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "slurm-wlm"]):
        done = _run(command, env=environment)
        if done.returncode != 0:
            return f"`{' '.join(command)}` failed: {(done.stdout + done.stderr)[-400:]}"
    return ""


@contextmanager
def cluster(folder: Path):
    """Yields (the environment to run sbatch with, "") or (None, why it could not start)."""
    why = install()
    if why:
        yield None, why
        return
    for name in ("state", "spool"):
        (folder / name).mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().split(".")[0]
    conf = folder / "slurm.conf"
    conf.write_text(CONF.format(host=host, folder=folder, port=free_port(), port_d=free_port(),
                                cpus=os.cpu_count() or 1))
    environment = {**os.environ, "SLURM_CONF": str(conf)}
    started: list[str] = []
    if _run(["munge", "-n"]).returncode != 0:  # no munge daemon answering yet
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        _run(["su", "-s", "/bin/sh", "munge", "-c", "munged --force"])
        started.append("munged")
    try:
        for daemon in ("slurmctld", "slurmd"):
            done = _run([daemon, "-f", str(conf)], env=environment)
            if done.returncode != 0:
                yield None, f"{daemon} did not start: {(done.stdout + done.stderr)[-400:]}"
                return
            started.append(daemon)
        deadline = time.monotonic() + 60
        while "idle" not in _run(["sinfo", "-h", "-o", "%T"], env=environment).stdout:
            if time.monotonic() > deadline:
                yield None, "the node never came up idle: " + (folder / "slurmd.log").read_text()[-400:]
                return
            time.sleep(1)
        yield environment, ""
    finally:
        for daemon in reversed(started):
            pid = folder / f"{daemon}.pid"
            if pid.is_file():
                subprocess.run(["kill", pid.read_text().strip()], check=False)
            elif daemon == "munged":
                subprocess.run(["pkill", "-x", "munged"], check=False)
