"""A crash costs at most one checkpoint interval: ``examples/train.py`` (``ckpt_path=auto``, its default) under
``torchrun --max-restarts`` with a rank SIGKILLed in the middle of a save, during start-up and at a random training step
(seeded) (`faulty_train.py`), comes back each time, resumes from the newest complete checkpoint and ends with the loss
curve and the parameters of the same run uninterrupted (its first generation, which ran to the end). Under Lightning's
own launcher (which does not restart) the same command run again resumes. ``benchmarks/restarts.py`` repeats these
10 times."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_nd.checkpoint import latest_checkpoint, read_sharded
from tests.e2e.test_train import REPO

STEPS, EVERY = 8, 4
RUN = [f"trainer.max_steps={STEPS}", f"checkpoint.every_n_train_steps={EVERY}", "trainer.limit_val_batches=0"]
LAYOUTS = {"dp_shard x tp": ["parallel=fsdp_tp", "trainer.devices=4"],
           "pp x dp_shard": ["parallel=pp", "trainer.devices=4", "diagnostics=off"]}
SEED = 45


def launch(folder: Path, command: list[str], faults: list[dict] | None = None, timeout: float = 300) -> tuple[int, str]:
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([*command, f"hydra.run.dir={folder / 'run'}"], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "FAULTS": json.dumps(faults or []), "OMP_NUM_THREADS": "1"})
    (folder / "output.txt").write_text(done.stdout + done.stderr)
    return done.returncode, done.stdout + done.stderr


def torchrun(restarts: int, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", f"--max-restarts={restarts}",
            "tests/e2e/faulty_train.py", *overrides, *RUN]


def losses(folder: Path) -> list[tuple[str, int, float]]:
    return [tuple(json.loads(line)) for line in (folder / "run" / "losses.jsonl").read_text().splitlines()]


def final(folder: Path) -> dict[str, torch.Tensor]:
    path = latest_checkpoint(folder / "run" / "checkpoints")
    assert path is not None and path.name == f"step={STEPS}.ckpt", path
    return read_sharded(path, progress=lambda _: None)["state_dict"]


def staged(folder: Path) -> dict[str, torch.Tensor]:
    """The model of a save cut short after every rank wrote (`faulty_train.py` copied it): DCP reads it whole."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(folder), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state["model"]


def resumed_steps(output: str) -> list[int]:
    return [int(step) for step in re.findall(r"`ckpt_path='auto'` resumes from `[^`]+` \(step (\d+)[,)]", output)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torchrun_restarts_resume_from_the_newest_complete_checkpoint_and_equal_the_uninterrupted_run(layout, tmp_path):
    """The first generation runs uninterrupted to the last step and dies saving it (so the cut save is the reference:
    its losses, and the state it staged); the next ones die in start-up (dp_shard x tp) and at a seeded step; the last
    one ends with the first's curve and parameters, from the checkpoint on."""
    killed_at = random.Random(f"{SEED}{layout}").randint(EVERY + 1, STEPS - 1)  # a step after the first save
    faults = [{"round": "0.0", "rank": 3, "at": "save", "step": STEPS}]
    if layout == "dp_shard x tp":
        faults.append({"round": "1.0", "rank": 2, "at": "init"})
    faults.append({"round": f"{len(faults)}.0", "rank": 1, "at": "step", "step": killed_at})
    code, output = launch(tmp_path, torchrun(len(faults), LAYOUTS[layout]), faults, timeout=600)
    assert code == 0, output[-6000:]
    rows = losses(tmp_path)
    rounds = sorted({round_ for round_, _, _ in rows})  # generations that trained (a death in start-up trains none)
    assert rounds == sorted({f["round"] for f in faults if f["at"] != "init"} | {f"{len(faults)}.0"}), rows
    assert resumed_steps(output) == [EVERY, EVERY], output[-6000:]  # after the step kill too: the cut save left 4 newest
    assert killed_at - EVERY <= EVERY  # the work the step kill lost: at most one interval
    assert "found no complete checkpoint" in output  # the first generation started fresh
    uninterrupted = {step: loss for round_, step, loss in rows if round_ == "0.0"}
    last = {step: loss for round_, step, loss in rows if round_ == rounds[-1]}
    assert sorted(uninterrupted) == list(range(1, STEPS + 1)) and sorted(last) == list(range(EVERY + 1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([last[s] for s in sorted(last)]),
                               torch.tensor([uninterrupted[s] for s in sorted(last)]), rtol=1e-5, atol=1e-7)
    got, expected = final(tmp_path), staged(tmp_path / "run" / f"cut-save-{STEPS}")
    assert got.keys() == expected.keys() and len(expected) > 0
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_under_lightnings_launcher_the_same_command_again_resumes_where_the_crash_left_off(tmp_path):
    """Lightning's launcher does not restart: the user runs the command again. Killed at a seeded step, then in the
    middle of the save of the last step: each run again resumes from the newest complete checkpoint (step 4 both
    times: the cut save left none newer) and replays the same losses."""
    command = [sys.executable, "tests/e2e/faulty_train.py", "parallel=fsdp", "trainer.devices=2", "diagnostics=off", *RUN]
    killed_at = random.Random(SEED).randint(EVERY + 1, STEPS - 1)
    runs = []
    for faults in ([{"round": "0.0", "rank": 1, "at": "step", "step": killed_at}],
                   [{"round": "0.0", "rank": 1, "at": "save", "step": STEPS}], []):
        code, output = launch(tmp_path, command, faults)
        assert (code == 0) == (not faults), output[-6000:]
        runs.append((output, losses(tmp_path)[sum(len(curve) for _, curve in runs):]))
    assert [resumed_steps(output) for output, _ in runs] == [[], [EVERY], [EVERY]]
    assert all("written by run `" in output for output, _ in runs[1:])  # each command again is a run of its own
    first, cut, last = ({step: loss for _, step, loss in curve} for _, curve in runs)
    assert sorted(first) == list(range(1, killed_at + 1)) and sorted(cut) == sorted(last) == list(range(EVERY + 1, STEPS + 1))
    assert last == cut and all(last[step] == first[step] for step in range(EVERY + 1, killed_at + 1))
