"""Hydra runs of ``examples/train.py``: a sweep ending with its comparison (a refused and a crashed run among its rows)
and the layout search, run exactly as a user runs them (``python examples/train.py -m ...``: Lightning starts the
other processes; the README's main job is in test_main_job.py); the other runs start one process per rank as
torchrun does (the torchrun variables set, each forked from the test session's zygotes, `tests/zygote.py`). Results
are read back with TensorBoard's own event reader."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util.tensor_util import make_ndarray

from diagnostics.records import LABELS
from tests.launcher import exits, start
from tests.unit.host_profiles import synthetic_profile

TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")

REPO = Path(__file__).resolve().parents[2]


def quick_start_commands() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section, flags=re.S)


def train_args(command: str) -> list[str]:
    """The arguments the README passes to examples/train.py."""
    words = shlex.split(command.split("&&")[-1])
    return words[words.index("examples/train.py") + 1:]


def run_train_script(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """examples/train.py in its own process (Lightning then launches the other ranks from there)."""
    return subprocess.run([sys.executable, "examples/train.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def run_train_ranks(args: list[str], world: int, out_dir: Path, timeout: float = 600,
                    torchrun: bool = True) -> tuple[list[int | None], str]:
    """examples/train.py on ``world`` processes, each a rank as torchrun starts it (``torchrun=False``: a plain
    ``python examples/train.py`` in one process, without the torchrun variables). Returns every rank's exit code
    (None: still running at ``timeout``, then killed) and all their output."""
    environment = None if torchrun else dict.fromkeys(TORCHRUN_VARIABLES)
    procs = start("tests.e2e.train_rank:run", world, out_dir, environment=environment, argv=args)
    ended = exits(procs, timeout)
    output = "\n".join((out_dir / f"rank{rank}.log").read_text() for rank in range(world))
    return [ended[rank][0] if rank in ended else None for rank in range(world)], output


def events(folder: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def layout_card(accumulator: EventAccumulator) -> str:
    return make_ndarray(accumulator.Tensors("lightning_nd/layout/text_summary")[0].tensor_proto)[0].decode()


def test_readme_quick_start_is_two_commands_sharing_one_setup():
    commands = quick_start_commands()
    assert len(commands) == 2
    setup = commands[0].split("&& .venv/bin/python")[0]
    assert commands[1].startswith(setup) and "pip install torch==2.13.0" in setup
    assert commands[1].endswith("-m pytest")
    assert (REPO / ".ci" / "run").read_text().count(commands[1]) == 1, ".ci/run must run the README's test command"


def test_hydra_sweep_runs_every_layout_and_ends_with_the_comparison(tmp_path):
    """Five layouts that train, one the strategy refuses (tp=3 on 4 ranks) and one that crashes in its first step
    (token ids beyond the model's vocabulary): every run is a row, the sweep goes on and names the best."""
    extra = tmp_path / "conf" / "parallel"
    extra.mkdir(parents=True)
    (extra / "refused.yaml").write_text("tp: 3\n")
    (extra / "crashes.yaml").write_text("# @package _global_\nparallel:\n  dp_shard: -1\ndata:\n  vocab_size: 100000\n")
    layouts = {"fsdp": "Applied FSDP (shard=4)", "hsdp": "HSDP (replicate=2 x shard=2)",
               "ddp": "replicate=4", "tp": "tensor parallel (tp=4", "cp": "context parallel (cp=2"}
    sweep = tmp_path / "sweep"
    done = run_train_script(["-m", f"parallel={','.join([*layouts, 'refused', 'crashes'])}", "trainer.devices=4",
                             "trainer.max_steps=3", "trainer.val_check_interval=3", f"hydra.sweep.dir={sweep}",
                             f"hydra.searchpath=[file://{tmp_path / 'conf'}]"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for job, expected in enumerate(layouts.values()):
        accumulator = events(sweep / str(job) / "tensorboard")
        assert len(accumulator.Scalars("train_loss")) == 3
        assert expected in layout_card(accumulator)
    assert done.stdout.count("### Sweep comparison") == 1, done.stdout[-3000:]  # rank 0's process only
    table = json.loads((sweep / "compare.json").read_text())
    rows = {row["name"]: row for row in table["rows"]}
    assert sorted(rows, key=int) == [str(job) for job in range(7)]
    assert [rows[str(job)]["status"] for job in range(7)] == ["ok"] * 5 + ["refused", "crash"]
    assert "does not divide world_size=4" in rows["5"]["reason"] and "HINT" in rows["5"]["reason"]
    assert "failed by itself: failed: IndexError: index out of range" in rows["6"]["reason"]
    assert rows["6"]["layout"] == "dp_shard=4"
    speeds = {name: row["record"]["tokens_per_s"] for name, row in rows.items() if row["status"] == "ok"}
    assert all(speed > 0 for speed in speeds.values()) and table["best"] == max(speeds, key=speeds.get)
    ranked = sorted(speeds.values(), reverse=True)
    assert table["margin"] == pytest.approx(ranked[0] / ranked[1] - 1)
    best = rows[table["best"]]
    assert f"Best: `{best['layout']}` (run {table['best']})" in done.stdout
    batch_ranks = {"0": 4, "1": 4, "2": 4, "3": 1, "4": 2}  # data.batch_size=8 samples per batch rank
    for name, row in ((name, rows[name]) for name in speeds):  # what was measured and what was predicted
        record = row["record"]
        assert record["steps"] == 3 and record["step_s"] > 0 and len(record["peak_bytes"]) == 4
        assert record["predicted_step_s"] > 0 and record["predicted_peak_bytes"] > 0 and record["hardware"] == "cpu"
        assert record["bottleneck"] in LABELS and record["final_loss"] > 0 and record["first_loss"] > 0
        assert record["global_batch"] == 8 * batch_ranks[name]
        assert row["global_batch_differs"] == (record["global_batch"] != best["record"]["global_batch"])
    offline = subprocess.run([sys.executable, "-m", "diagnostics", "compare", str(sweep), "--json"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert offline.returncode == 0 and json.loads(offline.stdout)["best"] == table["best"], offline.stderr
    card = events(sweep / "compare")
    assert "| 6: parallel=crashes |" in make_ndarray(
        card.Tensors("diagnostics/compare/text_summary")[0].tensor_proto)[0].decode()


def test_layout_search_measures_the_planners_first_layouts_and_gives_a_line_that_runs(tmp_path):
    profile = synthetic_profile().save(tmp_path / "profile.json")  # pinned: the order does not follow this host
    done = run_train_script(["-m", "parallel=search", "trainer.devices=4", "--budget", "2", "search.steps=4",
                             f"search.profile={profile}", f"hydra.sweep.dir={tmp_path}"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "valid layouts planned at a global batch of 32" in done.stdout and "measuring 2" in done.stdout
    assert f"layouts priced by the profile of {synthetic_profile().host} ({profile}," in done.stdout
    table = json.loads((tmp_path / "0" / "compare.json").read_text())
    assert [row["status"] for row in table["rows"]] == ["ok", "ok"] and table["best"] in ("0", "1")
    label = f"profile of {synthetic_profile().host} (measured 2025-01-01)"  # the table priced as the search ranked
    assert all(row["record"]["hardware"] == label and row["record"]["predicted_step_s"] > 0 for row in table["rows"])
    assert f"Predicted steps priced by: {label}." in done.stdout
    layouts = {row["layout"] for row in table["rows"]}
    assert len(layouts) == 2, layouts  # two different sets of dim sizes, not one layout's knobs twice
    assert done.stdout.count("### Sweep comparison") == 1
    line = done.stdout.split("Run the best layout with:\n", 1)[1].splitlines()[0].strip()
    assert line.startswith("python examples/train.py parallel=fsdp") and "trainer.devices=4" in line
    again = run_train_script([*shlex.split(line)[2:], "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'again'}"])
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    record = json.loads((tmp_path / "again" / "tensorboard" / "diagnostics" / "run.json").read_text())
    best = table["rows"][[row["name"] for row in table["rows"]].index(table["best"])]
    assert record["status"] == "ok" and describe(record["dims"]) == best["layout"].split()[0]


def describe(dims: dict) -> str:
    return ",".join(f"{d}={dims[d]}" for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
                    if dims[d] > 1 or d == "dp_shard")


def test_3d_layout_trains_on_8_processes(tmp_path):
    """pp=2 x dp_shard=2 x tp=2 (+SP), the issue's acceptance command, shortened to 10 steps."""
    codes, output = run_train_ranks(["parallel=3d", "trainer.devices=8", "trainer.max_steps=10",
                                     "trainer.val_check_interval=10", "trainer.limit_val_batches=1",
                                     f"hydra.run.dir={tmp_path}"], 8, tmp_path / "ranks")
    assert codes == [0] * 8, output[-6000:]
    accumulator = events(tmp_path / "tensorboard")
    losses = [event.value for event in accumulator.Scalars("train_loss")]
    assert len(losses) == 10 and len(accumulator.Scalars("val_loss")) == 1
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0, losses
    card = layout_card(accumulator)
    assert "| `pp` | 2 |" in card and "Split the model into 2 pipeline stages" in card


def test_moe_model_trains_under_expert_parallelism(tmp_path):
    codes, output = run_train_ranks(["model=moe", "parallel=ep", "trainer.devices=4", "trainer.max_steps=10",
                                     "trainer.val_check_interval=10", "trainer.limit_val_batches=1",
                                     f"hydra.run.dir={tmp_path}"], 4, tmp_path / "ranks")
    assert codes == [0] * 4, output[-6000:]
    accumulator = events(tmp_path / "tensorboard")
    losses = [event.value for event in accumulator.Scalars("train_loss")]
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    assert "Applied expert parallel (ep=2) to 2 experts modules" in layout_card(accumulator)


@pytest.mark.parametrize("override, message", [
    ("parallel.tp=3", "does not divide"),
    ("+parallel.dq=2", "has no option `dq`"),
])
def test_bad_override_fails_before_training_with_a_hint(override, message, tmp_path):
    """In one plain process: it must fail before Lightning starts the other three."""
    codes, output = run_train_ranks(["parallel=fsdp_tp", "trainer.devices=4", override, f"hydra.run.dir={tmp_path}"],
                                    1, tmp_path / "ranks", timeout=300, torchrun=False)
    assert codes[0] not in (0, None)
    assert message in output and "HINT" in output
    assert "Initializing distributed" not in output, "the error must come before any process group starts"


def test_resume_under_another_layout_from_the_command_line(tmp_path):
    codes, output = run_train_ranks(["parallel=tp", "trainer.devices=2", "trainer.max_steps=4",
                                     "checkpoint.every_n_train_steps=2", f"hydra.run.dir={tmp_path / 'first'}"], 2,
                                    tmp_path / "first_ranks")
    assert codes == [0, 0], output[-6000:]
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    assert last.resolve().name == "step=4.ckpt"
    codes, output = run_train_ranks(["parallel=fsdp", "trainer.devices=2", "trainer.max_steps=6", f"ckpt_path={last}",
                                     f"hydra.run.dir={tmp_path / 'second'}"], 2, tmp_path / "second_ranks")
    assert codes == [0, 0], output[-6000:]
    assert "resharded" in output and "'tp': 2" in output and "Restored all states" in output
    manifest = json.loads((tmp_path / "second" / "checkpoints" / "last.ckpt" / "lightning_nd.json").read_text())
    assert manifest["global_step"] == 6 and manifest["layout"]["tp"] == 1
