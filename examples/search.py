"""``parallel=search``: the planner's layouts for this model and world size, the most promising few measured, one
table and the best layout as a line to copy.

    python examples/train.py -m parallel=search trainer.devices=4 --budget 3

`lightning_nd.planner.shortlist` lists every valid layout (ZeRO stage, microbatches under pp, the least recomputation
that fits) at one global batch and drops those predicted not to fit; each of the first ``search.budget`` runs as its
own ``examples/train.py`` process (Lightning starts its ranks) for ``search.steps`` steps, in ``runs/<i>/`` of this
job's folder, stopped after ``search.timeout_s`` (a hang). `diagnostics compare` then reads ``runs/``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch import nn

from diagnostics.analysis.compare import compare
from diagnostics.records import RUN_FILE, RunRecord, find_runs, to_json, write_atomic
from diagnostics.report.compare_card import write_comparison
from lightning_nd.cost.hardware import parse_bytes
from lightning_nd.cost.op_count import count_model_ops
from lightning_nd.mesh.dims import DIM_NAMES
from lightning_nd.planner.pricing import Pricing, choose_pricing, priced_by
from lightning_nd.planner.search import Candidate, describe_sizes
from lightning_nd.planner.shortlist import Shortlist, per_rank_batch, shortlist
from lightning_nd.planner.source import Holder

SCRIPT = Path(__file__).resolve()
OWN_KEYS = ("parallel", "search", "hydra.", "trainer.max_steps", "trainer.limit_val_batches", "checkpoint.",
            "diagnostics.profile")
"""Overrides the search sets itself on each measured run (the user's others are passed on)."""
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
                  "MASTER_PORT")
"""Set when the search runs inside another run's processes (a sweep's earlier job): each measured run starts its own."""
GRACE_S = 5.0


def layout_overrides(candidate: Candidate) -> list[str]:
    """The command-line overrides that run ``candidate`` (on top of the user's other overrides)."""
    options = candidate.layout.options
    words = ["parallel=fsdp"] + [f"parallel.{d}={candidate.sizes[d]}" for d in DIM_NAMES
                                 if candidate.sizes[d] != 1 or d == "dp_shard"]
    if candidate.sizes["dp_shard"] > 1:
        words.append(f"parallel.zero_stage={options.zero_stage}")
    if options.activation_checkpointing != "none":
        words.append(f"parallel.activation_checkpointing={options.activation_checkpointing}")
    if candidate.sizes["tp"] > 1:
        words.append(f"parallel.sequence_parallel={str(options.sequence_parallel).lower()}")
    if candidate.sizes["pp"] > 1:
        words += [f"parallel.pp_schedule={options.pp_schedule}", f"parallel.pp_microbatches={options.pp_microbatches}"]
    return [*words, f"data.batch_size={per_rank_batch(candidate)}"]


def _memory(cfg: DictConfig, ranks: int) -> int:
    if cfg.search.memory:
        return parse_bytes(cfg.search.memory)
    if cfg.trainer.accelerator in ("gpu", "cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks


def meta_model(factory: Callable[[], nn.Module]) -> Holder:
    """The model ``factory`` builds, on the meta device (no memory, no init), held as the planner reads it."""
    with torch.device("meta"):
        return Holder(factory())


def plan_candidates(cfg: DictConfig, model_factory) -> tuple[Shortlist, int, Pricing]:
    devices, nodes = cfg.trainer.devices, int(cfg.trainer.num_nodes)
    if devices in (-1, "auto") and cfg.trainer.accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        devices = torch.cuda.device_count()
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"The layout search needs the number of ranks per node; `trainer.devices={devices}` does"
                         " not give it here. HINT: set `trainer.devices=N`.")
    ranks = devices * nodes
    priced = choose_pricing(cfg.search.profile, devices, knob="search.profile=")
    global_batch = cfg.search.global_batch or cfg.data.batch_size * ranks
    model = meta_model(model_factory(cfg.model))
    found = shortlist(model, ranks, devices, _memory(cfg, ranks), cfg.data.seq_len, global_batch,
                      precision=str(cfg.trainer.precision), hardware=priced.hardware, profile=priced.profile,
                      ops=count_model_ops(model) if priced.profile is not None else None)
    print(f"lightning-nd search: layouts priced by {priced_by(priced)}", flush=True)
    return found, global_batch, priced


def _measure(index: int, candidate: Candidate, passed: list[str], cfg: DictConfig, runs: Path, priced: Pricing) -> str:
    """One measured run in its own process group; a run still going at the timeout is killed and recorded as a
    hang, one that left no record as a crash with its exit status."""
    folder = runs / str(index)
    folder.mkdir(parents=True, exist_ok=True)
    steps = int(cfg.search.steps)
    command = [sys.executable, str(SCRIPT.parent / "train.py"), *passed, *layout_overrides(candidate),
               f"trainer.max_steps={steps}", "trainer.limit_val_batches=0",
               f"diagnostics.profile={priced.profile_path or priced.hardware.name}",
               f"diagnostics.bottleneck_every_n_steps={steps}",
               "checkpoint.save_top_k=0", "checkpoint.save_last=false", f"hydra.run.dir={folder}"]
    started, code = time.perf_counter(), None
    environment = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}  # a run of its own
    with open(folder / "console.log", "w") as console:
        process = subprocess.Popen(command, stdout=console, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=environment)
        try:
            code = process.wait(timeout=cfg.search.timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:  # the run's ranks too (its own process group), on a timeout, Ctrl-C or any error here
            _stop(process.pid)
            process.wait()
    record = folder / "diagnostics" / RUN_FILE
    if not any(folder.rglob(f"diagnostics/{RUN_FILE}")):
        why = (f"no end within search.timeout_s={cfg.search.timeout_s:g} s: stopped" if code is None else
               f"exited with status {code} and left no record (see {folder / 'console.log'})")
        write_atomic(record, to_json(RunRecord("hang" if code is None else "crash", why)))
    return f"{time.perf_counter() - started:.0f} s, exit status {code if code is not None else 'none (stopped)'}"


def _stop(group: int) -> None:
    """SIGTERM to the run's process group, SIGKILL to what is left after a grace period."""
    for sent in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(group, sent)
        except ProcessLookupError:
            return
        time.sleep(GRACE_S if sent == signal.SIGTERM else 0)


def run_search(cfg: DictConfig, overrides: list[str], output_dir: Path, model_factory) -> float:
    found, global_batch, priced = plan_candidates(cfg, model_factory)
    chosen = list(found.ordered[:cfg.search.budget])
    print(f"lightning-nd search: {found.planned} valid layouts planned at a global batch of {global_batch}"
          f" ({len(found.dropped)} predicted not to fit, dropped; {len(found.skipped)} kinds of invalid size sets);"
          f" measuring {len(chosen)} (search.budget={cfg.search.budget}) for {cfg.search.steps} steps each.",
          flush=True)
    if not chosen:
        raise RuntimeError("The planner found no layout predicted to fit. HINT: give `search.memory` (one rank's"
                           " memory) if the default is wrong, or a smaller model or `data.seq_len`.")
    passed = [o for o in overrides if not o.lstrip("+~").startswith(OWN_KEYS)]
    runs = output_dir / "runs"
    for index, candidate in enumerate(chosen):
        predicted = candidate.cost.time.total_s if candidate.cost.time is not None else float("nan")
        print(f"[{index + 1}/{len(chosen)}] {describe_sizes(candidate.sizes)} {candidate.options}"
              f" (predicted step {predicted * 1e3:.1f} ms) ...", flush=True)
        print(f"[{index + 1}/{len(chosen)}] done: {_measure(index, candidate, passed, cfg, runs, priced)}", flush=True)
    comparison = compare(find_runs(runs))
    print("\n" + write_comparison(output_dir, comparison), flush=True)
    if comparison.best is None:
        raise RuntimeError(f"No measured layout trained: see the table's reasons and {runs}/<i>/console.log.")
    best = chosen[int(comparison.best.name)]
    print("Run the best layout with:\n  python examples/train.py " + " ".join([*layout_overrides(best), *passed]),
          flush=True)
    return float(comparison.best.tokens_per_s or 0.0)
