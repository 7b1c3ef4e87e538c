"""Restart checks too long for the suite (`tests/e2e/test_restarts.py` runs one of each), printed as one table.

    python benchmarks/restarts.py [--repeats 10] [--only why,exact,shrink] [--out /tmp/restarts]

- ``why``: the issue's two cases as written. ``examples/train.py`` under ``torchrun --nproc-per-node=2 --max-restarts=1``
  (``parallel=fsdp parallel.dp_shard=2 trainer.max_steps=150 checkpoint.every_n_train_steps=10``), one worker SIGKILLed
  from outside near step 73: the restart resumes from the first generation's newest complete checkpoint and finishes.
  And Lightning's ``BoringModel`` (300 steps) under ``NDParallel(dp_shard=2)``, killed the same way, finishes.
- ``exact``: ``--repeats`` crash-then-resume runs per layout (dp_shard x tp, pp x dp_shard), each rank and step drawn
  from the repeat's seed, against one uninterrupted run: the loss curve from the checkpoint on and the final parameters
  (``rtol=1e-5, atol=1e-7``), and the work lost (at most one checkpoint interval).
- ``shrink``: two torchrun agents (``--nnodes=1:2``) of 2 processes; one agent and its workers are SIGKILLed after step
  6; the other resumes alone under ``dp_shard=-1`` refilled to 2, from the 4-rank checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.test_restarts import EVERY, LAYOUTS, STEPS, final, launch, losses, resumed_steps, torchrun  # noqa: E402
from tests.launcher import free_port  # noqa: E402

PYTHON = sys.executable


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it (torchrun starts its workers in sessions of their own)."""
    found = [pid]
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
        if parent == pid:
            found += descendants(int(entry))
    return found


def kill_when(process: subprocess.Popen, ready, which: int | None = None) -> None:
    """SIGKILL one worker of ``process`` (a torchrun agent) once ``ready()``; ``which=None``: the agent and all."""
    while not ready():
        if process.poll() is not None:
            raise RuntimeError("the run ended before the fault")
        time.sleep(0.2)
    tree = descendants(process.pid)
    targets = tree if which is None else [sorted(tree[1:])[which]]
    for pid in targets:
        os.kill(pid, signal.SIGKILL)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def why(out: Path, seed: int) -> list[str]:
    rows = []
    killed_near = random.Random(seed).randint(65, 80)
    folder = out / "why_example"
    folder.mkdir(parents=True, exist_ok=True)
    log = open(folder / "output.txt", "w")
    agent = subprocess.Popen([PYTHON, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1",
                              "tests/e2e/faulty_train.py", "parallel=fsdp", "parallel.dp_shard=2", "trainer.devices=2",
                              "trainer.max_steps=150", "checkpoint.every_n_train_steps=10",
                              f"hydra.run.dir={folder / 'run'}"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    kill_when(agent, lambda: lines(folder / "run" / "losses.jsonl") >= killed_near, which=1)
    code = agent.wait(timeout=900)
    output = (folder / "output.txt").read_text()
    steps = [step for _, step, _ in losses(folder)]
    rows.append(f"example, killed near step {killed_near}: exit {code}, resumed from step {resumed_steps(output)},"
                f" last step {max(steps)}")
    toy = folder.parent / "why_toy.py"
    toy.write_text(
        "from lightning.pytorch import Trainer\nfrom lightning.pytorch.demos.boring_classes import BoringModel\n"
        "from lightning_nd import NDParallel\n"
        "trainer = Trainer(strategy=NDParallel(dp_shard=2), accelerator='cpu', devices=2, max_steps=300,"
        " enable_progress_bar=False, logger=False, enable_checkpointing=False)\n"
        "trainer.fit(BoringModel())\nprint('FINISHED', trainer.global_step, flush=True)\n")
    log = open(folder.parent / "why_toy.txt", "w")
    agent = subprocess.Popen([PYTHON, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1", str(toy)],
                             cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    time.sleep(12)  # started and training: a BoringModel epoch is a fraction of a second
    kill_when(agent, lambda: True, which=1)
    code = agent.wait(timeout=600)
    finished = (folder.parent / "why_toy.txt").read_text().count("FINISHED 300")
    rows.append(f"BoringModel, killed while training: exit {code}, ranks finished after the restart: {finished}")
    return rows


def exact(out: Path, repeats: int) -> list[str]:
    rows = []
    for layout, overrides in LAYOUTS.items():
        reference = out / f"reference_{layout.replace(' ', '')}"
        code, output = launch(reference, torchrun(0, overrides), timeout=600)
        assert code == 0, output[-4000:]
        want_curve = {step: loss for _, step, loss in losses(reference)}
        want = final(reference)
        passed, worst, lost = 0, 0.0, []
        for repeat in range(repeats):
            draw = random.Random(repeat)
            step, rank = draw.randint(EVERY + 1, STEPS - 1), draw.randint(0, 3)
            folder = out / f"crash_{layout.replace(' ', '')}_{repeat}"
            code, output = launch(folder, torchrun(1, overrides),
                                  [{"round": "0.0", "rank": rank, "at": "step", "step": step}], timeout=600)
            resumed = resumed_steps(output)
            if code != 0 or not resumed:
                print(f"  {layout} repeat {repeat}: exit {code}, resumed {resumed}", flush=True)
                continue
            lost.append(step - resumed[0])
            curve = {s: loss for round_, s, loss in losses(folder) if round_ == "1.0"}
            got = final(folder)
            difference = max([abs(curve[s] - want_curve[s]) for s in curve]
                             + [float((got[n] - want[n]).abs().max()) for n in want])
            worst = max(worst, difference)
            try:
                torch.testing.assert_close(torch.tensor([curve[s] for s in sorted(curve)]),
                                           torch.tensor([want_curve[s] for s in sorted(curve)]), rtol=1e-5, atol=1e-7)
                for name in want:
                    torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)
                passed += 1
            except AssertionError as error:
                print(f"  {layout} repeat {repeat}: {str(error)[:300]}", flush=True)
        rows.append(f"{layout}: {passed}/{repeats} equal the uninterrupted run (largest difference {worst:.2e});"
                    f" steps lost {lost} (interval {EVERY})")
    return rows


def shrink(out: Path) -> list[str]:
    folder, port, agents = out / "shrink", free_port(), []
    folder.mkdir(parents=True, exist_ok=True)
    for node in range(2):
        log = open(folder / f"agent{node}.log", "w")
        agents.append(subprocess.Popen(
            [PYTHON, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=shrink", "--max-restarts=1",
             "--rdzv-conf=last_call_timeout=10,join_timeout=120", "tests/e2e/faulty_train.py", "parallel=fsdp",
             "trainer.devices=2", "trainer.max_steps=12", "checkpoint.every_n_train_steps=4",
             "trainer.limit_val_batches=0", "diagnostics=off", f"hydra.run.dir={folder / 'run'}"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}))
        time.sleep(0.5)  # the first agent hosts the rendezvous store; the second never comes back
    kill_when(agents[1], lambda: lines(folder / "run" / "losses.jsonl") >= 6)
    started = time.monotonic()
    code = agents[0].wait(timeout=600)
    output = (folder / "agent0.log").read_text()
    warned = [line for line in output.splitlines() if "was saved under" in line]
    after = [step for round_, step, _ in losses(folder) if round_ == "1.0"]
    return [f"one agent of two killed after step 6: the other exits {code} {time.monotonic() - started:.0f} s later,"
            f" resumed from step {resumed_steps(output)} on {'2 ranks' if 'MEMBER: 2/2' in output else '?'}, trained"
            f" steps {min(after, default=None)}-{max(after, default=None)}; warnings: {len(warned)}:"
            f" {warned[0][warned[0].find('lightning-nd'):][:400] if warned else ''}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--only", default="why,exact,shrink")
    parser.add_argument("--out", type=Path, default=Path("/tmp/restarts"))
    args = parser.parse_args()
    started, rows = time.monotonic(), {}
    for part in args.only.split(","):
        rows[part] = {"why": lambda: why(args.out, 45), "exact": lambda: exact(args.out, args.repeats),
                      "shrink": lambda: shrink(args.out)}[part]()
        print(json.dumps({part: rows[part]}, indent=1), flush=True)
    print(f"\nrestart checks on {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, {time.monotonic() - started:.0f} s")
    for part, found in rows.items():
        for row in found:
            print(f"{part:7s} {row}")


if __name__ == "__main__":
    main()
