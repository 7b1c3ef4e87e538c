"""The dry run: what a layout does to a model, before any GPU is touched.

    python -m lightning_nd.plan --model examples.models.llama:Llama --devices 8 --layout tp=2,pp=2,dp_shard=2
    python -m lightning_nd.plan --hf-model-type llama --hf-kwargs '{"num_hidden_layers": 80, ...}' \\
        --devices 64 --layout tp=8,pp=4,dp_shard=2 --gpus-per-node 8 --seq-len 4096 --micro-batch 8 [--json]
    python -m lightning_nd.plan --calibrate      # measure this host for the cost model (`pricing.py`)

It builds the model on the meta device, makes the run's `Layout` with the very functions `NDParallel` uses
(`dry_run.py`: every error and warning is the one the real run would raise, with the same HINT; the strategy
itself is never built, so neither Lightning nor, for a model of your own, transformers is imported), and prints it:
what each dim splits, the mesh roles, the TP style per module pattern and its source, the stage split,
the experts, and what one rank holds. ``--json`` prints the Layout as one JSON document instead.
No process group is started. Exit status 2 on a bad layout (the message on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from lightning_nd.cost.hardware import parse_bytes
from lightning_nd.layout.describe import human_bytes, layout_markdown
from lightning_nd.layout.record import Layout
from lightning_nd.planner.dry_run import dry_run, parse_layout
from lightning_nd.planner.pricing import add_arguments as add_pricing_arguments
from lightning_nd.planner.pricing import calibrate_command, pricing
from lightning_nd.planner.run import add_arguments as add_planner_arguments
from lightning_nd.planner.run import cost_markdown, cost_section, fit_line, layout_precision, layout_step, run_planner
from lightning_nd.planner.source import build_model, storage_line

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_nd.plan", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="MODULE:FACTORY, a callable returning an nn.Module or a LightningModule")
    source.add_argument("--hf-config", help="a Hugging Face config.json (its `model_type` names the family)")
    source.add_argument("--hf-model-type", help="a Hugging Face model type (llama, mixtral, qwen2, ...)")
    parser.add_argument("--hf-kwargs", default="{}", help="JSON: config fields (with --hf-model-type or --hf-config)")
    parser.add_argument("--devices", type=int, help="world size (all processes, all nodes); required except with"
                                                   " --calibrate")
    parser.add_argument("--layout", help="dim sizes, e.g. tp=8,pp=4,dp_shard=2 (dp_shard fills the rest); without it and"
                                         " with --gpu-memory, the planner ranks every valid layout")
    parser.add_argument("--options", default="{}", help="JSON: any other NDParallel keyword, e.g. '{\"zero_stage\": 2}'")
    parser.add_argument("--precision", choices=PRECISIONS, help="the Trainer's precision (default: 32-true for a"
                                                                  " layout, bf16-mixed for the planner)")
    parser.add_argument("--gpus-per-node", type=int, help="processes per node (warns when tp/cp/ep cross nodes)")
    parser.add_argument("--seq-len", type=int, help="sequence length: also run the checks a batch triggers")
    parser.add_argument("--micro-batch", type=int, help="samples per rank in one batch (with --seq-len); for the"
                                                        " planner, samples per forward (default 1)")
    parser.add_argument("--check", action="store_true", help="also set up every distinct rank for real and run one"
                        " training step on fake tensors (torch's fake process group, this one CPU process); exit 1 on"
                        " the first error, named with its rank and module (default --seq-len 1024, --micro-batch the"
                        " microbatch count)")
    parser.add_argument("--json", action="store_true", help="print the Layout (and its cost) as one JSON document")
    add_planner_arguments(parser)
    add_pricing_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """The dry run, or the planner, for parsed arguments; a bad configuration raises (`main` prints it)."""
    start = time.perf_counter()
    if args.params is not None and (args.model or args.hf_config or args.hf_model_type):
        raise ValueError("`--params` stands for a model not given. HINT: pass either the model or `--params N`.")
    if args.params is None and not (args.model or args.hf_config or args.hf_model_type):
        raise ValueError("No model to plan. HINT: pass `--model MODULE:FACTORY`, `--hf-model-type llama` or"
                         " `--hf-config config.json` (or `--params N` with `--gpu-memory` for model state only).")
    if args.params is not None and args.layout is not None:
        raise ValueError("`--params` plans model state without a model, `--layout` plans a model's layout."
                         " HINT: drop `--layout` (and add `--gpu-memory`), or give the model instead of `--params`.")
    if args.check and args.layout is None:
        raise ValueError("`--check` runs one layout. HINT: add `--layout tp=...,pp=...`.")
    priced = pricing(args)
    precision = layout_precision(args)
    module = build_model(args.model, args.hf_config, args.hf_model_type, json.loads(args.hf_kwargs), precision) if (
        args.params is None) else None
    if args.layout is None and (args.gpu_memory or args.params is not None):
        if args.gpu_memory is None:
            raise ValueError("`--params` plans against a GPU's memory. HINT: add `--gpu-memory 80GB`.")
        return run_planner(args, module, json.loads(args.options), priced)
    options = json.loads(args.options)
    workload, implied = layout_step(args, options)
    sizes = parse_layout(args.layout or "")
    layout = dry_run(module, args.devices, sizes, {**implied, **options}, precision=precision,  # --check: batch at its step
                     gpus_per_node=args.gpus_per_node, seq_len=None if args.check else args.seq_len,
                     micro_batch=workload.batch if workload is not None else args.micro_batch)
    if args.check:
        args.micro_batch = workload.batch if workload is not None and args.global_batch else args.micro_batch
        return check(args, module, layout, {**sizes, **implied, **options}, precision)
    cost = cost_section(layout, module, args, workload, priced)
    memory_bytes = parse_bytes(args.gpu_memory) if args.gpu_memory else None
    fits = cost is None or memory_bytes is None or cost.peak.peak_bytes <= memory_bytes
    if args.json:
        priced = {**cost.to_dict(), **({"memory_bytes": memory_bytes, "fits": fits} if memory_bytes else {})} if (
            cost is not None) else None
        print(json.dumps({**layout.to_dict(), "cost": priced}) if priced is not None else layout.to_json())
        return 0 if fits else 1
    total = sum(p.numel() for p in module.parameters())
    print(f"# Dry run: {type(getattr(module, 'model', module)).__name__}, {total:,} parameters"
          f" ({human_bytes(sum(p.numel() * p.element_size() for p in module.parameters()))}), {args.devices} devices\n")
    print(storage_line(module, precision, getattr(module, "config_dtype", None)) + "\n")
    print(layout_markdown(layout))
    if cost is not None:
        print("\n" + cost_markdown(layout, cost, total))
        if memory_bytes is not None and workload is not None:
            print("\n" + fit_line(cost, memory_bytes, workload))
    print(f"Planned in {time.perf_counter() - start:.1f} s; no process group was started.", file=sys.stderr)
    return 0 if fits else 1


def check(args: argparse.Namespace, module: Any, layout: Layout, arguments: dict[str, Any], precision: str) -> int:
    """`--check`: the one entry into `lightning_nd.check` (above the strategy; imported only here)."""
    from lightning_nd.check import check_layout, check_markdown

    print(f"Checking the ranks of {args.devices} on fake tensors ...", file=sys.stderr)
    result = check_layout(module, layout, arguments, precision=precision, gpus_per_node=args.gpus_per_node,
                          seq_len=args.seq_len or 1024, micro_batch=args.micro_batch,
                          progress=lambda line: print(line, file=sys.stderr))
    print(json.dumps(dataclasses.asdict(result)) if args.json else check_markdown(result))
    return result.exit_code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.devices is None and not args.calibrate:
        parser.error("the following arguments are required: --devices")
    try:
        return calibrate_command(args) if args.calibrate else run(args)
    except (ValueError, TypeError, json.JSONDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
