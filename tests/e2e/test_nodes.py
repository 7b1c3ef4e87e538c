"""Two nodes on one machine: two torchrun agents (``--nnodes=2``, c10d rendezvous on 127.0.0.1), each starting 2
processes of ``examples/train.py trainer.num_nodes=2``, as a user moving to a cluster runs it. Against one torchrun
agent of 4 processes: the same losses when tp stays inside a node (fsdp_tp: tp=2 on each node's two ranks), the
topology warning when tp crosses nodes (tp=4 over two nodes of 2), and a resume on one node from the checkpoint the
two nodes wrote, continuing the loss curve of the uninterrupted one-node run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_train import REPO, events
from tests.launcher import free_port

STEPS = ["trainer.max_steps=4", "trainer.limit_val_batches=0", "diagnostics=off", "checkpoint.every_n_train_steps=2"]


def torchrun(folder: Path, nodes: int, per_node: int, overrides: list[str], timeout: float = 300) -> str:
    """``nodes`` torchrun agents of ``per_node`` processes each (one machine, rendezvous on 127.0.0.1); every agent
    must exit 0. Returns all their output."""
    port, agents = free_port(), []
    folder.mkdir(parents=True, exist_ok=True)
    for node in range(nodes):
        log = open(folder / f"agent{node}.log", "w")
        agents.append((subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={per_node}",
             f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=nodes",
             "examples/train.py", f"trainer.devices={per_node}", f"trainer.num_nodes={nodes}", *overrides,
             f"hydra.run.dir={folder / 'run'}"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for process, log in agents:
        try:
            codes.append(process.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(None)
        log.close()
    output = "\n".join((folder / f"agent{node}.log").read_text() for node in range(nodes))
    assert codes == [0] * nodes, output[-6000:]
    return output


def losses(folder: Path) -> list[float]:
    return [event.value for event in events(folder / "run" / "tensorboard").Scalars("train_loss")]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("one_node")
    torchrun(folder, 1, 4, ["parallel=fsdp_tp", *STEPS])
    return folder


def test_two_nodes_train_as_one_when_tp_stays_inside_a_node_and_resume_on_one(one_node, tmp_path):
    output = torchrun(tmp_path / "two", 2, 2, ["parallel=fsdp_tp", *STEPS])
    assert "span 2 nodes" not in output
    reference = losses(one_node)
    assert len(reference) == 4
    assert losses(tmp_path / "two") == pytest.approx(reference, rel=1e-6, abs=0)
    written = tmp_path / "two" / "run" / "checkpoints" / "step=2.ckpt"
    assert written.is_dir(), sorted(p.name for p in written.parent.iterdir())
    output = torchrun(tmp_path / "resumed", 1, 4, ["parallel=fsdp_tp", *STEPS, f"ckpt_path='{written}'"])
    assert "Restored all states" in output
    assert losses(tmp_path / "resumed")[-2:] == pytest.approx(reference[2:], rel=1e-6, abs=0)


def test_tp_across_nodes_trains_and_says_it_crosses_the_slow_network(tmp_path):
    output = torchrun(tmp_path, 2, 2, ["parallel=tp", "trainer.max_steps=2", "trainer.limit_val_batches=0",
                                       "diagnostics=off"])
    assert "`tp=4` makes groups of 4 neighbouring ranks, which span 2 nodes of 2 processes" in output
    assert "HINT: keep tp inside a node" in output
    assert len(losses(tmp_path)) == 2
