"""Which job and which restart round a process belongs to, as its launcher says (`lightning_nd/runtime/job.py`)."""

from __future__ import annotations

import os
import re

from lightning_nd.runtime.job import restart_round, run_key, store_prefix


def test_every_restart_round_has_its_own_store_prefix():
    fresh, torchrun_restart = {}, {"TORCHELASTIC_RESTART_COUNT": "1"}
    requeued = {"TORCHELASTIC_RESTART_COUNT": "0", "SLURM_RESTART_COUNT": "2"}
    assert [restart_round(env) for env in (fresh, torchrun_restart, requeued)] == ["0.0", "1.0", "0.2"]
    prefixes = {store_prefix("watchdog", env) for env in (fresh, torchrun_restart, requeued)}
    assert len(prefixes) == 3 and store_prefix("watchdog", fresh) == "lightning_nd/watchdog/0.0/"
    assert store_prefix("diagnostics", fresh) != store_prefix("watchdog", fresh)


def test_the_run_key_is_the_same_for_every_restart_of_a_job():
    assert run_key({"SLURM_JOB_ID": "17", "SLURM_RESTART_COUNT": "1", "TORCHELASTIC_RUN_ID": "x"}) == "slurm-17"
    assert run_key({"TORCHELASTIC_RUN_ID": "nodes", "TORCHELASTIC_RESTART_COUNT": "3"}) == "torchrun-nodes"
    assert run_key({"TORCHELASTIC_RUN_ID": "none"}) == f"torchrun-agent{os.getppid()}"  # torchrun's default id
    assert re.fullmatch(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", run_key({}))  # a plain run: the time of day
