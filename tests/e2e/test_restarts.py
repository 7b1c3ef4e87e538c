"""A crash costs at most one checkpoint interval: ``examples/train.py`` (``ckpt_path=auto``, its default) under
``torchrun --max-restarts`` with a rank SIGKILLed during start-up, at a random training step (seeded) and in the middle
of a save (`faulty_train.py`), comes back each time, resumes from the newest complete checkpoint and ends with the loss
curve and the parameters of the same run uninterrupted; under Lightning's own launcher (which does not restart) the
same command run again resumes. The 10-repeat version of these checks is ``benchmarks/restarts.py``."""

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


def resumed_steps(output: str) -> list[int]:
    return [int(step) for step in re.findall(r"`ckpt_path='auto'` resumes from `[^`]+` \(step (\d+)\)", output)]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def uninterrupted(request, tmp_path_factory) -> tuple[str, Path]:
    folder = tmp_path_factory.mktemp("uninterrupted")
    code, output = launch(folder, torchrun(0, LAYOUTS[request.param]))
    assert code == 0, output[-6000:]
    return request.param, folder


def test_torchrun_restarts_resume_from_the_newest_complete_checkpoint_and_equal_the_uninterrupted_run(
        uninterrupted, tmp_path):
    layout, reference = uninterrupted
    killed_at = random.Random(f"{SEED}{layout}").randint(EVERY + 1, STEPS - 1)  # a step after the first save
    faults = [{"round": "0.0", "rank": 1, "at": "step", "step": killed_at}]
    if layout == "dp_shard x tp":  # and a death in start-up before it, and one in the middle of the save of step 8
        faults = [{"round": "0.0", "rank": 2, "at": "init"}, {**faults[0], "round": "1.0"},
                  {"round": "2.0", "rank": 3, "at": "save", "step": STEPS}]
    restarts = len({fault["round"] for fault in faults})
    code, output = launch(tmp_path, torchrun(restarts, LAYOUTS[layout]), faults)
    assert code == 0, output[-6000:]
    rounds = {round_: step for round_, step, _ in losses(tmp_path)}  # each generation's last step
    assert sorted(rounds) == [f"{r}.0" for r in range(1 if layout == "dp_shard x tp" else 0, restarts + 1)], rounds
    assert killed_at - max(resumed_steps(output)[:1] or [0]) <= EVERY  # the work lost: at most one interval
    expected_resumes = [EVERY, EVERY] if layout == "dp_shard x tp" else [EVERY]  # the killed save left step 4 newest
    assert resumed_steps(output) == expected_resumes, output[-6000:]
    assert f"found no complete checkpoint in {tmp_path / 'run' / 'checkpoints'}" in output  # a fresh start
    last_round = max(rounds)
    curve = {step: loss for round_, step, loss in losses(tmp_path) if round_ == last_round}
    want = {step: loss for _, step, loss in losses(reference)}
    assert sorted(curve) == list(range(EVERY + 1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([curve[s] for s in sorted(curve)]),
                               torch.tensor([want[s] for s in sorted(curve)]), rtol=1e-5, atol=1e-7)
    got, expected = final(tmp_path), final(reference)
    assert got.keys() == expected.keys()
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
    first, cut, last = ({step: loss for _, step, loss in curve} for _, curve in runs)
    assert sorted(first) == list(range(1, killed_at + 1)) and sorted(cut) == sorted(last) == list(range(EVERY + 1, STEPS + 1))
    assert last == cut and all(last[step] == first[step] for step in range(EVERY + 1, killed_at + 1))
