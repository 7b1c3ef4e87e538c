"""The docs: the README is the landing page (at most 300 lines, its links reach pages that exist), `docs/` builds
with MkDocs in strict mode (a broken link, an anchor that does not exist, a page left out of the nav fails), and
every shell command they show is run here or excluded with its reason:

- ``python -m lightning_nd.plan ...``: run as written (exit 0);
- ``python -m diagnostics ...``: run with the run folder it names (``outputs/<date>/<time>/...``) replaced by a
  recorded one of the same kind (`tests/data`), or a sweep folder made here;
- ``python examples/train.py ...`` (alone or under torchrun; its two-node run is tests/e2e/test_nodes.py): composed
  by Hydra exactly as written (each job of a ``-m`` sweep, ``--budget``
  as the script reads it), the layout built and planned for its world size with every check a run makes before its
  first batch; each layout they name trains in tests/e2e (the quick start's job, the sweeps, the search, resume);
- the quick-start commands: run by tests/e2e/test_main_job.py and by CI itself (`.ci/run`);
- `EXCLUDED`: the benchmark scripts (minutes of processes each; docs/pages/performance.md reports their numbers).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lightning_nd.mesh.dims import DIM_NAMES

REPO = Path(__file__).resolve().parents[2]
PAGES = REPO / "docs" / "pages"
EXCLUDED = {"benchmarks/": "a benchmark: minutes of processes on 2 cores; docs/pages/performance.md has its numbers"}
RECORDED = {"hang": REPO / "tests" / "data" / "records" / "hang_pp2_dp2",
            "nccl": REPO / "tests" / "data" / "nccl" / "single_node_nvlink"}


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted(PAGES.rglob("*.md"))]


def commands() -> list[tuple[str, list[str]]]:
    """(file, argv) of every command in a ``bash`` (``sh``, ``shell``) block: continuation lines joined, comments
    dropped. Other blocks hold output or code, not commands."""
    found = []
    for path in doc_files():
        for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", path.read_text(), flags=re.S):
            pending = ""
            for line in block.replace("\\\n", " ").splitlines():
                pending += line + "\n"
                try:
                    words = shlex.split(pending, comments=True)
                except ValueError:  # a quote still open: the command goes on on the next line
                    continue
                if words and all(words != seen for _, seen in found):  # the README repeats some of the pages'
                    found.append((str(path.relative_to(REPO)), words))
                pending = ""
    return found


def kind(argv: list[str]) -> str:
    if argv[0] == "python3":
        return "quick start"
    if argv[0].endswith("torchrun"):
        return "torchrun"
    script = argv[1] if len(argv) > 1 else ""
    if script == "-m":
        return argv[2]
    if any(script.startswith(prefix) for prefix in EXCLUDED):
        return "excluded"
    return script


COMMANDS = commands()


def _ids(items: list[tuple[str, list[str]]]) -> list[str]:
    return [f"{file}:{' '.join(argv)[:60]}" for file, argv in items]


def test_the_readme_is_a_landing_page_whose_links_reach_the_docs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    links = re.findall(r"\]\(([^)#]+)\)", readme)
    assert len(links) >= 10 and all((REPO / link).is_file() for link in links), links
    assert {str(p.relative_to(REPO)) for p in PAGES.rglob("*.md")} - {"docs/pages/index.md"} <= set(links)


def test_the_docs_build_in_strict_mode(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "-f", str(REPO / "docs" / "mkdocs.yml"),
                           "--strict", "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "sweeps" / "index.html").is_file()


def test_every_command_is_run_here_or_excluded_with_its_reason():
    kinds = {kind(argv) for _, argv in COMMANDS}
    assert kinds == {"quick start", "lightning_nd.plan", "diagnostics", "examples/train.py", "torchrun",
                     "excluded"}, kinds
    from tests.e2e.test_train import quick_start_commands

    quick = [shlex.split(c) for c in quick_start_commands()]
    assert [argv for _, argv in COMMANDS if kind(argv) == "quick start"] == quick


def test_plan_commands_run_as_written():
    """All in one process (``main(argv)`` of ``python -m lightning_nd.plan``, one after the other): torch and
    transformers are imported once."""
    plans = [argv[3:] for _, argv in COMMANDS if kind(argv) == "lightning_nd.plan"]
    assert len(plans) >= 4
    script = ("import json, sys\nfrom lightning_nd.planner.__main__ import main\n"
              "codes = [main(argv) for argv in json.loads(sys.argv[1])]\nprint('exit codes', codes)")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(plans)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and f"exit codes {[0] * len(plans)}" in done.stdout, done.stdout[-3000:] + done.stderr
    assert done.stdout.count("# Planner:") == sum("--gpu-memory" in argv and "--layout" not in argv for argv in plans)


@pytest.mark.parametrize("file, argv", [c for c in COMMANDS if kind(c[1]) == "diagnostics"],
                         ids=_ids([c for c in COMMANDS if kind(c[1]) == "diagnostics"]))
def test_diagnostics_commands_run_on_a_folder_of_the_kind_they_name(file, argv, tmp_path):
    command = argv[3]
    if command == "compare":
        from diagnostics.records import RunRecord
        from tests.diagnostics.test_compare import job, ok

        job(tmp_path / "0", ["parallel=fsdp"], ok(100.0))
        job(tmp_path / "1", ["parallel=tp"], RunRecord("refused", "ValueError: no."))
        folder, codes = tmp_path, (0,)
        expected = ("Best: `dp_shard=4` (run 0)", "REFUSED: ValueError: no.")
    else:
        folder, codes = RECORDED[command], (0, 1)  # 1: a culprit named, or an NCCL finding that is an error
        expected = {"hang": ("hang verdict",), "nccl": ("NCCL",)}[command]
    assert "<date>/<time>" in argv[4]
    done = subprocess.run([sys.executable, *argv[1:4], str(folder), *argv[5:]], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode in codes, done.stdout[-2000:] + done.stderr[-2000:]
    assert all(text in done.stdout for text in expected), done.stdout[-2000:]


def _jobs(words: list[str]) -> list[list[str]]:
    """The overrides of each job the command runs (a ``-m`` sweep: every combination of its comma lists)."""
    from examples.train import budget_flag

    words = budget_flag(words)
    if "-m" not in words:
        return [words]
    jobs: list[list[str]] = [[]]
    for word in (w for w in words if w != "-m"):
        key, _, values = word.partition("=")
        choices = values.split(",") if "," in values and not values.startswith("[") else [values]
        jobs = [[*job, f"{key}={value}"] for job in jobs for value in choices]
    return jobs


TRAINING = [c for c in COMMANDS if kind(c[1]) in ("examples/train.py", "torchrun")]


@pytest.mark.parametrize("file, argv", TRAINING, ids=_ids(TRAINING))
def test_training_commands_compose_and_plan_as_written(file, argv, tmp_path):
    from examples.schema import compose
    from examples.train import model_factory
    from lightning_nd.planner.dry_run import dry_run
    from lightning_nd.planner.source import Holder

    given = argv[argv.index("examples/train.py") + 1:]  # under torchrun, its own arguments come first
    for overrides in _jobs([word.replace("<date>/<time>", "2026-12-05/07-14-42") for word in given]):
        cfg = compose(overrides)
        world = cfg.trainer.devices * cfg.trainer.num_nodes
        if cfg.search.enabled:
            from examples.search import plan_candidates
            from tests.unit.host_profiles import synthetic_profile

            cfg.search.profile = str(synthetic_profile().save(tmp_path / "profile.json"))  # not this host's
            found, _, _ = plan_candidates(cfg, model_factory)
            assert len(found.ordered) >= cfg.search.budget
            continue
        with torch.device("meta"):
            built = model_factory(cfg.model)()
        options = OmegaConf.to_container(cfg.parallel, resolve=True)
        sizes = {d: options.pop(d) for d in DIM_NAMES}
        layout = dry_run(Holder(built), world, sizes, options, seq_len=cfg.data.seq_len,
                         micro_batch=cfg.data.batch_size)
        assert layout.dims["world_size"] == world
