"""The dry run: what a layout does to a model, before any GPU is touched.

    python -m lightning_nd.plan --model examples.models.llama:Llama --devices 8 --layout tp=2,pp=2,dp_shard=2
    python -m lightning_nd.plan --hf-model-type llama --hf-kwargs '{"num_hidden_layers": 80, ...}' \\
        --devices 64 --layout tp=8,pp=4,dp_shard=2 --gpus-per-node 8 --seq-len 4096 --micro-batch 8 [--json]

It builds the model on the meta device, makes the run's `Layout` with the very functions `NDParallel` uses
(so every error and warning is the one the real run would raise, with the same HINT), and prints it:
what each dim splits, the mesh roles, the TP style per module pattern and its source, the stage split,
the experts, and what one rank holds. ``--json`` prints the Layout as one JSON document instead.
No process group is started. Exit status 2 on a bad layout (the message on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
from torch import nn

from lightning_nd.layout.describe import human_bytes, layout_markdown
from lightning_nd.layout.dims import DIM_NAMES, ParallelDims, closest_name
from lightning_nd.layout.record import Layout
from lightning_nd.plan.planner import add_arguments as add_planner_arguments
from lightning_nd.plan.planner import cost_markdown, cost_section, run_planner
from lightning_nd.plan.source import build_model, is_lightning_module

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")


def parse_layout(text: str) -> dict[str, int]:
    """``tp=8,pp=4,dp_shard=2`` -> ``{"tp": 8, "pp": 4, "dp_shard": 2}``; a typo names the closest dim."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in DIM_NAMES:
            raise ValueError(f"Unknown parallel dim `{name}` in `--layout {text}`. HINT: did you mean"
                             f" `{closest_name(name, DIM_NAMES)}`? Valid dims: {', '.join(DIM_NAMES)}.")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"`--layout {text}`: `{part}` needs an integer size. HINT: e.g. `{name}=2`.") from None
    return sizes


def dry_run(module: nn.Module, devices: int, sizes: dict[str, int], options: dict[str, Any], *,
            precision: str | None = None, gpus_per_node: int | None = None, seq_len: int | None = None,
            micro_batch: int | None = None) -> Layout:
    """Everything `Trainer(devices=devices, strategy=NDParallel(**sizes, **options)).fit(module)` checks before
    its first step, in the same order, and the Layout it makes. ``module``: the LightningModule (or a
    `Holder` of the model)."""
    from lightning_nd.strategy.nd_parallel import NDParallel

    strategy = NDParallel.from_config({**sizes, **options})  # the constructor's own checks
    layout = plan_for(strategy, devices, module, precision=precision, gpus_per_node=gpus_per_node)
    if seq_len is not None:
        check_batch_shape(layout, seq_len, micro_batch or 1)
    return layout


def plan_for(strategy: Any, devices: int, module: nn.Module | None, *, precision: str | None = None,
             gpus_per_node: int | None = None) -> Layout | None:
    """What `Trainer(devices=devices, strategy=strategy)` checks when built, then what ``connect(module)``
    plans (None without a module)."""
    from lightning_nd.layout.plan import plan_layout
    from lightning_nd.layout.validate import check_config

    dims = ParallelDims(**strategy._sizes, world_size=devices)  # as `_configure_launcher` makes them
    check_config(dims.as_dict(), strategy.config)
    if module is None:
        return None
    if is_lightning_module(module):
        from lightning_nd.strategy.probe import model_to_check

        probe = model_to_check(module)
        if probe is None:
            raise ValueError(f"`{type(module).__name__}.configure_model` needs the running job (the device mesh), so"
                             " its model cannot be built before launch. HINT: plan a factory of the model itself.")
        module = probe
    return plan_layout(module, dims, strategy.config, precision=precision, local_world_size=gpus_per_node or devices)


def check_batch_shape(layout: Layout, seq_len: int, micro_batch: int) -> None:
    """The checks the strategy makes when a batch of this shape arrives (token ids [micro_batch, seq_len])."""
    from lightning_nd.layout.validate import check_sequence_lengths
    from lightning_nd.parallel.context.sharding import shard_batch
    from lightning_nd.parallel.pipeline.schedule import check_microbatches

    dims = layout.dims
    batch = {"input_ids": torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")}
    if dims["cp"] > 1:
        batch, _ = shard_batch(batch, dims["cp"], 0, None)
    if layout.options["sequence_parallel"]:
        check_sequence_lengths(batch, dims["tp"])
    if dims["pp"] > 1:
        check_microbatches(batch, layout.options["pp_microbatches"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_nd.plan", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="MODULE:FACTORY, a callable returning an nn.Module or a LightningModule")
    source.add_argument("--hf-config", help="a Hugging Face config.json (its `model_type` names the family)")
    source.add_argument("--hf-model-type", help="a Hugging Face model type (llama, mixtral, qwen2, ...)")
    parser.add_argument("--hf-kwargs", default="{}", help="JSON: config fields (with --hf-model-type or --hf-config)")
    parser.add_argument("--devices", type=int, required=True, help="world size (all processes, all nodes)")
    parser.add_argument("--layout", help="dim sizes, e.g. tp=8,pp=4,dp_shard=2 (dp_shard fills the rest); without it and"
                                         " with --gpu-memory, the planner ranks every valid layout")
    parser.add_argument("--options", default="{}", help="JSON: any other NDParallel keyword, e.g. '{\"zero_stage\": 2}'")
    parser.add_argument("--precision", choices=PRECISIONS, help="the Trainer's precision (default: 32-true for a"
                                                                  " layout, bf16-mixed for the planner)")
    parser.add_argument("--gpus-per-node", type=int, help="processes per node (warns when tp/cp/ep cross nodes)")
    parser.add_argument("--seq-len", type=int, help="sequence length: also run the checks a batch triggers")
    parser.add_argument("--micro-batch", type=int, help="samples per rank in one batch (with --seq-len); for the"
                                                        " planner, samples per forward (default 1)")
    parser.add_argument("--json", action="store_true", help="print the Layout (and its cost) as one JSON document")
    add_planner_arguments(parser)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        if args.params is not None and (args.model or args.hf_config or args.hf_model_type):
            raise ValueError("`--params` stands for a model not given. HINT: pass either the model or `--params N`.")
        if args.params is None and not (args.model or args.hf_config or args.hf_model_type):
            raise ValueError("No model to plan. HINT: pass `--model MODULE:FACTORY`, `--hf-model-type llama` or"
                             " `--hf-config config.json` (or `--params N` with `--gpu-memory` for model state only).")
        if args.params is not None and args.layout is not None:
            raise ValueError("`--params` plans model state without a model, `--layout` plans a model's layout."
                             " HINT: drop `--layout` (and add `--gpu-memory`), or give the model instead of `--params`.")
        module = build_model(args.model, args.hf_config, args.hf_model_type, json.loads(args.hf_kwargs)) if (
            args.params is None) else None
        if args.layout is None and (args.gpu_memory or args.params is not None):
            if args.gpu_memory is None:
                raise ValueError("`--params` plans against a GPU's memory. HINT: add `--gpu-memory 80GB`.")
            return run_planner(args, module, json.loads(args.options))
        layout = dry_run(module, args.devices, parse_layout(args.layout or ""), json.loads(args.options),
                         precision=args.precision or "32-true", gpus_per_node=args.gpus_per_node,
                         seq_len=args.seq_len, micro_batch=args.micro_batch)
        cost = cost_section(layout, module, args)
    except (ValueError, TypeError, json.JSONDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**layout.to_dict(), "cost": cost.to_dict()}) if cost is not None else layout.to_json())
        return 0
    total = sum(p.numel() for p in module.parameters())
    print(f"# Dry run: {type(getattr(module, 'model', module)).__name__}, {total:,} parameters"
          f" ({human_bytes(sum(p.numel() * p.element_size() for p in module.parameters()))}), {args.devices} devices\n")
    print(layout_markdown(layout))
    if cost is not None:
        print("\n" + cost_markdown(layout, cost, total))
    print(f"Planned in {time.perf_counter() - start:.1f} s; no process group was started.", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
