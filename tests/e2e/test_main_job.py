"""The README's main job, run once exactly as a user runs it (its first Quick start command's arguments to
``examples/train.py``), then checked three times: what it wrote (TensorBoard's own event reader), what it printed
(no warning, no negative epoch total), and the troubleshooting view as a user sees it: TensorBoard on 127.0.0.1
opened in headless Chromium, its custom-scalars, text and images tabs rendered, the screenshots kept in
``tests/artifacts/troubleshooting-view/`` (`tests/e2e/browser.py`)."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import NamedTuple

import pytest
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.util.tensor_util import make_ndarray

from diagnostics.records import BOTTLENECK_FILE, LABELS, read_windows
from lightning_nd import Layout
from tests.e2e.browser import Browser, ensure_chromium, tensorboard
from tests.e2e.test_train import events, layout_card, quick_start_commands, run_train_script, train_args

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "troubleshooting-view"
CATEGORIES = ("collectives", "communication", "memory", "step", "throughput")
WARNING_LINE = re.compile(
    r"^\S+\.py:\d+: "  # Python's warnings: `path:line: Category: message`, or `path:line: message` as Lightning prints
    r"|^(\[rank\d+\]:)?\[?W\d{4} "  # torch's: `[rank0]:W1206 05:28:48.668 pid path:line] ...`, C++ `[W1206 ...`
    r"|^(\[[^\]]*\]\[)?\S*\]?\[?WARNING\]? ?[-:]")  # Python logging: `WARNING:name:...`, Hydra's `[...][name][WARNING] -`


class MainJob(NamedTuple):
    folder: Path
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> MainJob:
    argv = train_args(quick_start_commands()[0])
    assert argv[:1] == ["parallel=fsdp_tp"] and "trainer.devices=4" in argv
    folder = tmp_path_factory.mktemp("main_job")
    done = run_train_script([*argv, f"hydra.run.dir={folder}"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return MainJob(folder, done.stdout, done.stderr)


def test_readme_main_job_prints_no_warning(main_job):
    """Lightning's and torch's internals said theirs (every rank: LeafSpec's deprecation, two sequential all_gathers
    per saved tensor; rank 0: the srun hint) and the bar said `Epoch 0/-2`: each is gone at its cause or silenced by
    its exact message (`lightning_nd/strategy/quiet.py`)."""
    warned = [line for line in main_job.stderr.splitlines() if WARNING_LINE.search(line)]
    assert not warned, "\n".join(warned)
    console = main_job.stdout + main_job.stderr  # rich's bar writes to stdout, tqdm's to stderr
    assert "Epoch 0" in console and not re.search(r"Epoch \d+/-", console), console[-2000:]


def test_readme_main_job_trains_and_writes_tensorboard(main_job):
    tmp_path = main_job.folder
    accumulator = events(tmp_path / "tensorboard")
    losses = [event.value for event in accumulator.Scalars("train_loss")]
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    card = layout_card(accumulator)
    assert "| `tp` | 2 |" in card and "| `dp_shard` | 2 |" in card
    assert "Applied tensor parallel (tp=2, sequence_parallel=True" in card and "Applied FSDP (shard=2)" in card
    assert "| `model.layers.*.self_attn.q_proj` | colwise | pattern | 4 |" in card and "Rank 0 (" in card
    layout = Layout.from_json((tmp_path / "tensorboard" / "layout.json").read_text())  # the plan, for offline tools
    assert layout.dims["tp"] == 2 and [t.technique for t in layout.techniques] == ["tensor_parallel", "fsdp"]
    topology = make_ndarray(accumulator.Tensors("diagnostics/topology/text_summary")[0].tensor_proto)[0].decode()
    assert "| backend | gloo |" in topology and "| tp | 2 x 2 ranks | none |" in topology, topology
    assert not (tmp_path / "tensorboard" / "diagnostics" / "hang.json").exists()  # a healthy run leaves no verdict
    assert not list((tmp_path / "tensorboard" / "diagnostics").glob("memory-rank*.json"))
    for rank in range(4):  # MemoryMonitor: each rank's model state and peak RSS every 10 steps (on CPU)
        state = [event.value for event in accumulator.Scalars(f"memory/model_state_bytes/rank{rank}")]
        assert len(state) == 2 and state[0] == state[1] > 0
        assert all(event.value > state[0] for event in accumulator.Scalars(f"memory/peak_rss_bytes/rank{rank}"))
    windows = read_windows((tmp_path / "tensorboard" / "diagnostics" / BOTTLENECK_FILE).read_text())
    assert [(w.context.first_step, w.context.last_step) for w in windows] == [(1, 10), (11, 20)]
    assert all(w.diagnosis.label in LABELS and w.diagnosis.advice for w in windows)
    assert all(r.comm.get("tp", 0) > 0 and r.comm.get("fsdp", 0) > 0 for r in windows[-1].ranks)
    card = make_ndarray(accumulator.Tensors("diagnostics/bottleneck/text_summary")[-1].tensor_proto)[0].decode()
    assert f"**{windows[-1].diagnosis.label}**" in card
    cores = len(os.sched_getaffinity(0))
    assert windows[-1].context.host_cores == {socket.gethostname(): cores}
    if cores < 4:  # four processes on fewer cores: said beside every class, first when compute is the verdict
        for window in windows:
            told = window.diagnosis.advice
            assert window.diagnosis.findings and any(line.startswith("give each process its own core") for line in told)
            assert window.diagnosis.label != "compute-bound" or told[0].startswith("give each process its own core")
            assert not any("precision='bf16-mixed'" in line for line in told), told
        assert "**Shared host:** host" in card and "precision='bf16-mixed'" not in card, card
    else:
        assert all(not w.diagnosis.findings for w in windows)
    view = layout_pb2.Layout()  # the troubleshooting view: one custom-scalars layout, every monitor's charts in it
    view.ParseFromString(make_ndarray(accumulator.Tensors("custom_scalars__config__")[0].tensor_proto).item())
    assert {c.title for c in view.category} == {"Troubleshooting: " + name for name in
                                               ("collectives", "communication", "memory", "step", "throughput")}
    for tag in ("bottleneck/step_s/max", "memory/model_state_bytes/mean", "collectives/strategy_wait_s/min",
                "throughput/tokens_per_s"):
        assert len(accumulator.Scalars(tag)) == 2, tag


def test_the_troubleshooting_view_renders_in_a_browser(main_job, tmp_path):
    binary, why = ensure_chromium()
    if binary is None:
        pytest.skip(f"the browser check needs Chromium: {why}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with tensorboard(main_job.folder / "tensorboard") as url:
        browser = Browser(binary, tmp_path / "profile")
        try:
            text = browser.open(f"{url}/#custom_scalars", lambda t: "Troubleshooting: throughput" in t
                                and "Matches (" in t)
            browser.screenshot(ARTIFACTS / "custom_scalars.png")
            for name in CATEGORIES:
                assert f"Troubleshooting: {name}" in text, text[:3000]
            for title in ("tokens/s over the batch ranks", "MFU", "step time (s)", "model state (bytes)"):
                assert title in text, title
            matched = [int(n) for n in re.findall(r"Matches \((\d+)\)", text)]
            assert sum(1 for n in matched if n > 0) >= 6, matched  # charts with their series drawn
            text = browser.open(f"{url}/#text",
                                lambda t: "lightning_nd/layout" in t and "diagnostics/bottleneck" in t)
            browser.screenshot(ARTIFACTS / "text.png")
            assert "Applied tensor parallel (tp=2" in text and "Applied FSDP (shard=2)" in text, text[:3000]
            window = read_windows((main_job.folder / "tensorboard" / "diagnostics" / BOTTLENECK_FILE).read_text())[-1]
            assert window.diagnosis.label in text and "diagnostics/topology" in text
            text = browser.open(f"{url}/#images", lambda t: "diagnostics/step_phases" in t)
            assert browser.images_shown() >= 1, text[:2000]  # the step-phases figure, decoded and drawn
            browser.screenshot(ARTIFACTS / "images.png")
        finally:
            browser.close()
