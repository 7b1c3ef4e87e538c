"""The planner half of ``python -m lightning_nd.plan``: cost one layout (``--layout`` with ``--seq-len``), or,
without ``--layout`` and with ``--gpu-memory``, rank every valid layout of the model on ``--devices`` GPUs.

    python -m lightning_nd.plan --hf-model-type llama --hf-kwargs '{"num_hidden_layers": 80, ...}' \\
        --devices 64 --gpus-per-node 8 --gpu-memory 80GB --seq-len 4096 --global-batch 512 [--json]
    python -m lightning_nd.plan --params 70e9 --devices 64 --gpus-per-node 8 --gpu-memory 80GB

With ``--params N`` (no model) only model state is known: "fits" is judged on it alone, and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lightning_nd.cost.hardware import PRESETS, parse_bytes
from lightning_nd.cost.layout_cost import LayoutCost, cost_layout
from lightning_nd.cost.model_state import OPTIMIZER_STATES, check_optimizer
from lightning_nd.cost.op_count import count_model_ops
from lightning_nd.cost.shape import Workload, model_shape
from lightning_nd.layout.describe import human_bytes
from lightning_nd.layout.plan import PlanMemo
from lightning_nd.layout.record import Layout
from lightning_nd.mesh.dims import ParallelDims
from lightning_nd.planner.dry_run import dry_run, parse_layout, read_layout_arguments
from lightning_nd.planner.params_only import params_only_markdown, params_only_rows
from lightning_nd.planner.pricing import Pricing, priced_by
from lightning_nd.planner.search import Batching, Search, batch_options, print_progress, search
from lightning_nd.planner.source import storage_line
from lightning_nd.planner.table import model_state_arithmetic, planner_json, planner_markdown, why


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-memory", help="memory of one GPU: 80GB, 80GiB, 512MB (a bare number is GB);"
                                             " without --layout this runs the planner")
    parser.add_argument("--global-batch", type=int, help="samples per optimizer step, all ranks together (planner)")
    parser.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZER_STATES), help="its state per parameter")
    parser.add_argument("--hardware", help=f"a preset ({', '.join(PRESETS)}; default h100) for the step-time"
                        " estimate, with overrides: h100,peak_flops=7e14,inter_node_bytes_per_s=25e9")
    parser.add_argument("--params", type=float, help="parameters, without a model: model state only (planner)")
    parser.add_argument("--top", type=int, default=20, help="rows of the planner's table")
    parser.add_argument("--explain", help="a layout (tp=8,pp=4,dp_shard=2) whose rank and model-state arithmetic the"
                                          " planner shows, whether it ranks high or not")


def run_planner(args: argparse.Namespace, module: Any, options: dict[str, Any], priced: Pricing) -> int:
    """Rank the layouts, priced by ``priced``; exit status 0 when one fits, 1 when none does."""
    memory_bytes = parse_bytes(args.gpu_memory)
    gpus_per_node = min(args.gpus_per_node or args.devices, args.devices)
    if gpus_per_node < 1:
        raise ValueError(f"`--gpus-per-node {args.gpus_per_node}` must be at least 1. HINT: e.g. `--gpus-per-node 8`.")
    if args.devices % gpus_per_node:
        raise ValueError(f"`--devices {args.devices}` is not a whole number of nodes of `--gpus-per-node"
                         f" {gpus_per_node}`. HINT: use a multiple of {gpus_per_node}.")
    if module is None:
        if args.json:
            rows = params_only_rows(int(args.params), args.devices, gpus_per_node, args.optimizer)
            print(json.dumps({"memory_bytes": memory_bytes, "model_state_only": True, "layouts": rows}))
            return 0 if any(row["model_state_bytes"] <= memory_bytes for row in rows) else 1
        text, fits = params_only_markdown(int(args.params), args.devices, gpus_per_node, memory_bytes, args.optimizer)
        print(text)
        return 0 if fits else 1
    if args.seq_len is None or args.global_batch is None:
        raise ValueError("The planner needs the step's shape. HINT: add `--seq-len 4096 --global-batch 512`"
                         " (and `--micro-batch` for samples per forward, default 1), or `--params N` for model"
                         " state only.")
    precision = args.precision or "bf16-mixed"
    batching = Batching(args.seq_len, args.global_batch, args.micro_batch or 1, precision)
    hardware = priced.hardware
    memo = PlanMemo()  # the candidates share the model: its blocks, tp plans and stage splits are found once

    def plan(sizes: dict[str, int], extra: dict[str, Any]) -> Layout:
        return dry_run(module, args.devices, sizes, {**options, **extra}, precision=precision,
                       gpus_per_node=gpus_per_node, memo=memo)

    ops = count_model_ops(module) if priced.profile is not None else None
    result = search(plan, model_shape(module), args.devices, gpus_per_node, memory_bytes, batching,
                    optimizer=args.optimizer, hardware=hardware, options=options,
                    progress=print_progress if sys.stderr.isatty() else None, profile=priced.profile, ops=ops)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    params = sum(p.numel() for p in module.parameters())
    if args.json:
        print(json.dumps(planner_json(result, memory_bytes)))
    else:
        print(f"# Planner: {params / 1e9:.2f}B parameters on {args.devices} GPUs ({gpus_per_node} per node,"
              f" {human_bytes(memory_bytes)} each), sequence {args.seq_len}, global batch {args.global_batch},"
              f" {precision}, {args.optimizer}, priced by {priced_by(priced)}\n")
        print(storage_line(module, precision, getattr(module, "config_dtype", None)) + "\n")
        print(planner_markdown(result, memory_bytes, params=params, top=args.top))
        if args.explain:
            print("\n" + explain(result, args.explain, args.devices, params))
    return 0 if any(c.fits for c in result.ranked) else 1


def explain(result: Search, text: str, devices: int, params: int) -> str:
    """Where the layout ``text`` ranks, why, and its model state's arithmetic."""
    wanted = ParallelDims(**parse_layout(text), world_size=devices).as_dict()
    for index, candidate in enumerate(result.ranked, start=1):
        if all(candidate.sizes[name] == wanted[name] for name in candidate.sizes):
            return (f"`{text}` ranks #{index} of {len(result.ranked)}: {why(candidate, result.ranked[0], 0)}.\n\n"
                    + model_state_arithmetic(candidate.layout, candidate.cost.peak, params))
    return f"`{text}` is not among the costed layouts (see \"Left out\" above)."


def layout_precision(args: argparse.Namespace) -> str:
    """``--precision``, else the planner's bf16-mixed when the layout is priced against a GPU (``--gpu-memory``),
    else a plain run's 32-true."""
    return args.precision or ("bf16-mixed" if args.gpu_memory else "32-true")


def layout_step(args: argparse.Namespace, options: dict[str, Any]) -> tuple[Workload | None, dict[str, Any]]:
    """With ``--layout``: the step to check and price (None without ``--seq-len``) and the options it implies. With
    ``--global-batch`` made as the ranking path makes it (samples per batch rank, under pp split into
    ``pp_microbatches`` of ``--micro-batch``), else ``--micro-batch`` samples per rank."""
    precision = layout_precision(args)
    if args.seq_len is None:
        return None, {}
    if args.global_batch is None:
        return Workload(args.seq_len, args.micro_batch or 1, 1, precision), {}
    arguments = read_layout_arguments({**parse_layout(args.layout), **options})  # the dry run's errors, first
    sizes = ParallelDims(**arguments.sizes, world_size=args.devices).as_dict()
    step = batch_options(sizes, Batching(args.seq_len, args.global_batch, args.micro_batch or 1, precision))
    if isinstance(step, str):
        raise ValueError(f"`--layout {args.layout} --global-batch {args.global_batch}`: {step}. HINT: choose a global"
                         f" batch that dp_replicate x dp_shard = {sizes['dp_replicate'] * sizes['dp_shard']} and"
                         " --micro-batch divide (under pp into at least pp microbatches), or run the planner"
                         " without --layout.")
    workload, implied = step
    return workload, {key: value for key, value in implied.items() if key != "pp_schedule"}


def cost_section(layout: Layout, module: Any, args: argparse.Namespace, workload: Workload | None,
                 priced: Pricing) -> LayoutCost | None:
    """The cost of the dry run's layout for ``workload`` (None without --seq-len), priced by ``priced``."""
    if workload is None:
        return None
    check_optimizer(args.optimizer)
    return cost_layout(layout, model_shape(module), workload, optimizer=args.optimizer,
                       hardware=priced.hardware, gpus_per_node=args.gpus_per_node, profile=priced.profile,
                       ops=count_model_ops(module) if priced.profile is not None else None)


def fit_line(layout_cost: LayoutCost, memory_bytes: int, workload: Workload) -> str:
    """Whether the highest rank's expected peak fits one GPU of ``--gpu-memory``, for which step and precision."""
    peak = layout_cost.peak
    verdict = "fits in" if peak.peak_bytes <= memory_bytes else "does not fit in"
    return (f"Expected peak {human_bytes(peak.peak_bytes)} on rank {peak.rank} {verdict} {human_bytes(memory_bytes)}"
            f" per GPU, for batches of {workload.batch} x {workload.seq_len} tokens x {workload.accumulation}"
            f" accumulation steps at {workload.precision} (parameters and optimizer state as that precision keeps"
            " them).")


def cost_markdown(layout: Layout, layout_cost: LayoutCost, params: int) -> str:
    """The cost section of the dry run: expected memory of each distinct rank, bytes per dim, step time, and the
    highest rank's model-state arithmetic."""
    cost = layout_cost.to_dict()
    lines = ["## Expected memory per rank (one training step)", "",
             "| rank | params | grads | optimizer | activations | temporaries | peak | at |",
             "|---|---|---|---|---|---|---|---|"]
    seen = set()
    for rank in cost["ranks"]:
        key = tuple(rank[k] for k in ("params_bytes", "activations_bytes", "peak_bytes"))
        if key in seen:
            continue
        seen.add(key)
        lines.append(f"| {rank['rank']} | " + " | ".join(human_bytes(rank[k]) for k in (
            "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temporaries_bytes", "peak_bytes"))
            + f" | {rank['peak_moment'].replace('_', ' ')} |")
    lines += ["", "Ranks not shown hold the same as one above.", "", "## Communication per step (rank 0)", "",
              "| dim | bytes | what |", "|---|---|---|"]
    lines += [f"| {dim} | {human_bytes(c['bytes'])} | {c['what']} |" for dim, c in cost["comm"].items()]
    time = cost["step_time"]
    if time:
        basis = (f"priced by the {time['priced_by']}" if time["priced_by"].startswith("profile")
                 else "estimate at peak FLOP/s")
        head = f"Step time ({basis}): {time['total_s']:.3f} s"
        if time.get("busy_share", 1.0) < 1:  # a profile whose ranks outnumbered its cores
            lines += ["", (f"{head}: compute {time['compute_s']:.3f} s + communication {time['exposed_comm_s']:.3f} s"
                           f" per rank over the {time['busy_share']:.0%} of the cores the ranks keep busy (they outnumber"
                           f" the cores: a pipeline bubble of {time['bubble_fraction']:.1%} is filled by the other ranks'"
                           " work" + (f", but while it fills and drains too few stages work to keep the cores busy: the"
                                     f" stage's work x {time['idle_fill']:.3f}" if time.get("idle_fill", 1.0) > 1 else "")
                           + ").")]
        else:
            lines += ["", (f"{head} = compute {time['compute_s']:.3f} s + exposed communication"
                           f" {time['exposed_comm_s']:.3f} s, over (1 - bubble {time['bubble_fraction']:.1%}).")]
    lines += ["", model_state_arithmetic(layout, layout_cost.peak, params)]
    return "\n".join(lines)
