"""Tensor + sequence parallelism: ``apply_tp(model, tp_mesh, entries, *, sequence_parallel, loss_parallel)``.

Without sequence parallelism the residual stream is replicated on every tp rank: colwise layers
fan out (no communication), rowwise layers all-reduce their output.

With sequence parallelism the residual stream is a DTensor sharded on the sequence dim: norms run
on their shard, each attention/MLP module all-gathers its input once (one hook per module, not one
per projection), and rowwise layers reduce-scatter back onto the sequence shards. Keeping the
residual a DTensor (not a local tensor) keeps ``hidden.shape[1]`` the global sequence length, which
models that derive positions from it (Hugging Face) rely on.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from lightning_nd.model.structure import (
    HEAD_ATTRS,
    get_submodule,
    is_linear,
    is_norm,
    owns_parameters,
    parent_name,
    widths,
)
from lightning_nd.tensor_parallel.apply.dropout import fork_rng_per_rank, has_dropout
from lightning_nd.tensor_parallel.apply.head_inputs import is_plain_float, local_head_inputs
from lightning_nd.tensor_parallel.apply.packed_heads import localize_head_counts
from lightning_nd.tensor_parallel.apply.ssm_channels import ChannelMixer
from lightning_nd.tensor_parallel.apply.stacked_experts import divide_stacked_widths
from lightning_nd.tensor_parallel.apply.styles import SEQUENCE_DIM, style_for
from lightning_nd.tensor_parallel.communication import gather_sequence
from lightning_nd.tensor_parallel.infer.checks import head_counts, is_colwise
from lightning_nd.tensor_parallel.infer.fused_heads import HeadLayout, head_layout
from lightning_nd.tensor_parallel.infer.mla import rope_dim
from lightning_nd.tensor_parallel.infer.per_feature import split_input_widths, split_output_widths, works_on_its_input
from lightning_nd.tensor_parallel.styles import PACKED_PARTS, STACKED_STYLES, style_has


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    entries: Mapping[str, object],
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    block_names: list[str],
) -> None:
    """Shard every module named in ``entries`` (concrete module names, see `tensor_parallel/infer/resolve.py`).

    ``block_names`` are the repeated blocks; with sequence parallelism they bound the sharded region.
    """
    split_parents = sorted({parent_name(name) for name, style in entries.items() if is_colwise(style)})
    stacked = [name for name, style in entries.items() if style in STACKED_STYLES]
    # A plain full input and output (under SP too), each projection reducing its own input gradient: RWKV mixes its
    # input with whole weights before any projection, JetMoE's MoA router reads it whole.
    plain = {name for name in split_parents if name not in block_names and (works_on_its_input(model, entries, name)
             or any(entry.startswith(name + ".") for entry in stacked))}
    for name, style in entries.items():
        if style in ("replicate", "channel_params"):  # every rank keeps the full parameters / split by the mixer
            continue
        shared = parent_name(name) not in block_names
        sp = sequence_parallel and parent_name(name) not in plain
        rope = (rope_dim(model, name) or 0) if style == "mla_kv_a_proj" else 0
        layout = head_layout(get_submodule(model, parent_name(name))) if style_has(style, by_heads=True) else None
        parallel_style = (
            style if isinstance(style, ParallelStyle)
            else ChannelMixer([child for child, _ in get_submodule(model, name).named_children()
                               if entries.get(f"{name}.{child}") == "channel_params"]) if style == "channel_mixer"
            else style_for(cast(str, style), sp, loss_parallel, shared, rope, layout)
        )
        parallelize_module(get_submodule(model, name), tp_mesh, parallel_style)
    tp_rank = tp_mesh.get_local_rank()
    divide_stacked_widths(model, [name for name in stacked if entries[name] == "stacked_colwise"], tp_mesh.size(),
                          WIDTH_ATTRS)
    for name in split_parents:
        module = get_submodule(model, name)
        # Inside another split module (NeoMME's gated output projection in its attention), its first input is the
        # outer module's local heads: neither whole nor shared with the outer module's projections.
        nested = any(name.startswith(outer + ".") for outer in split_parents if outer and outer not in block_names)
        heads = next((value for attr, value in head_counts(module).items() if attr in HEAD_ATTRS), None)
        features = split_output_widths(model, entries, name) - split_input_widths(model, entries, name)
        if (heads or features) and name not in block_names:
            module.register_forward_pre_hook(local_head_inputs(heads or 0, features, tp_mesh), with_kwargs=True)
        _divide_head_counts(name, module, tp_mesh.size(), entries)
        for child_name, child in _whole_children(name, module, entries) if name not in block_names else ():
            child.register_forward_pre_hook(_local_inputs, with_kwargs=True)
            child.register_forward_hook(partial(_check_no_gradient, child_name))
        # A module strictly inside a block (attention, MLP) shares its input once among all its
        # projections: one all-gather (SP) or none (replicated input), and in backward a single
        # reduction of the input gradient instead of one per projection (q, k, v: three). A block's
        # own projections handle their input themselves, so the residual between blocks stays sharded.
        if name in plain and sequence_parallel:
            _run_whole_under_sp(module, tp_mesh)
        elif name not in block_names and not nested and name not in plain:
            hook = _gather_sequence if sequence_parallel else _replicate_first_input(tp_mesh)
            module.register_forward_pre_hook(hook, with_kwargs=True)
        if name not in block_names and not nested:
            # Its activations are split by heads or features: each tp rank draws its own dropout masks.
            if has_dropout(module):
                fork_rng_per_rank(module, tp_rank)
    if sequence_parallel:  # layers whose output is gathered take the full sequence too (one gather per module)
        gathered = {parent_name(name) for name, style in entries.items() if style == "colwise_rep"}
        for name in sorted(gathered - {parent_name(n) for n, s in entries.items() if is_colwise(s)} - set(block_names)):
            get_submodule(model, name).register_forward_pre_hook(_gather_sequence, with_kwargs=True)
    if sequence_parallel:
        _mark_sequence_parallel_region(model, entries, tp_mesh, block_names)


def _mark_sequence_parallel_region(
    model: nn.Module, entries: Mapping[str, object], tp_mesh: DeviceMesh, block_names: list[str]
) -> None:
    """The residual stream is sequence-sharded from the first block to the head.

    A colwise head gathers the sequence itself; any other head gets a full tensor from the last
    module of the region (the final norm, or the last block when there is none).
    """
    enter = _enter_sequence_parallel(tp_mesh)
    for name in block_names:
        block = get_submodule(model, name)
        block.register_forward_pre_hook(enter, with_kwargs=True)
        # A block's own parameters meet the sequence-sharded residual (Doge's `input_residual * residual`): whole
        # DTensors on every tp rank, whose gradients (each rank's sequence shard) DTensor sums over tp.
        for param_name, param in list(block.named_parameters(recurse=False)):
            block.register_parameter(param_name, nn.Parameter(
                distribute_tensor(param, tp_mesh, [Replicate()]), requires_grad=param.requires_grad))
        for child_name, child in block.named_children():  # whole on every tp rank: the full sequence in and out
            full = f"{name}.{child_name}"
            planned = any(entry == full or entry.startswith(full + ".") for entry in entries)
            if not planned and not is_norm(child) and owns_parameters(child):
                _run_whole_under_sp(child, tp_mesh)
    if any(style == "colwise_gather_output" for style in entries.values()):
        return
    outside = [
        name for name, style in entries.items()
        if style == "sequence_parallel" and not any(name.startswith(b + ".") for b in block_names)
    ]
    last = outside[-1] if outside else block_names[-1]
    get_submodule(model, last).register_forward_hook(_leave_sequence_parallel)


HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size")
WIDTH_ATTRS = ("all_head_size", "embed_dim", "inner_dim", "hidden_size")
"""Attributes a module split by heads may reshape its heads' output with; divided by tp where they equal heads x
head_dim (the width before its rowwise layer) and a separate query projection has that width. Not beside a fused
one: CodeGen's ``embed_dim // mp_num`` is the width of a group of its fused rows, which must stay whole."""


def _whole_children(name: str, module: nn.Module, entries: Mapping[str, object]) -> list[tuple[str, nn.Module]]:
    """Children of a split module (by full name) that hold linear layers the plan leaves whole, none of their own in
    the plan (DeepSeek-V3.2's sparse-attention indexer): they run whole on every tp rank, on local inputs."""
    planned = lambda child: any((entry == child or entry.startswith(child + ".")) and not style_has(style, whole=True)  # noqa: E731
                                for entry, style in entries.items())
    prefix = f"{name}." if name else ""
    children = [(prefix + child_name, child) for child_name, child in module.named_children()]
    return [(full, child) for full, child in children
            if not is_linear(child) and not planned(full) and any(is_linear(sub) for sub in child.modules())]


def _local_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    local = lambda value: value.full_tensor() if isinstance(value, DTensor) else value  # noqa: E731
    return tuple(local(a) for a in args), {key: local(value) for key, value in kwargs.items()}


def _check_no_gradient(name: str, module: nn.Module, args: tuple, output: object) -> None:
    """A whole child's output must carry no gradient (the indexer's top-k mask, computed under no_grad): each tp
    rank would hand back the gradient of its own heads only, which nothing here sums."""
    outputs = output if isinstance(output, (tuple, list)) else (output,)
    if any(isinstance(value, torch.Tensor) and value.requires_grad for value in outputs):
        raise RuntimeError(
            f"Tensor parallelism: `{name}` runs whole on every tp rank (the plan splits none of its layers) and its"
            " output carries a gradient, which each tp rank would only have for its own heads. HINT: pass"
            f" `NDParallel(tp_plan=...)` that leaves `{parent_name(name)}` out (it then stays whole on every tp"
            " rank), or one that splits `{name}` too.")


def _divide_head_counts(name: str, module: nn.Module, tp: int, entries: Mapping[str, object]) -> None:
    """Modules that reshape with their head count must see the local count (heads / tp; the plan checked it).
    A module that splits a fused output by ``split_size`` (GPT-2's attention) splits the local width. One above a
    fused ``[q; k; v]`` split by head counts gets them as `localize_head_counts` sets them."""
    if any(parent_name(child) == name and style_has(style, by_heads=True) for child, style in entries.items()):
        localize_head_counts(module, cast(HeadLayout, head_layout(module)), tp)
        return
    counts = head_counts(module)
    head_dim = next((value for attr in HEAD_DIM_ATTRS if isinstance(value := getattr(module, attr, None), int)), None)
    heads = next((value for attr, value in counts.items() if attr in HEAD_ATTRS), None)
    for attr, value in counts.items():
        assert value % tp == 0, f"{name}.{attr}={value} passed the plan's check against tp={tp}"
        setattr(module, attr, value // tp)
    width = heads * head_dim if heads and head_dim else None
    query = any(parent_name(child) == name and is_colwise(style)
                and widths(get_submodule(module, child[len(name) + 1:] if name else child))[1] == width
                for child, style in entries.items())
    for attr in WIDTH_ATTRS if query else ():  # the heads' total width, in a reshape (RoFormer, MVP)
        if getattr(module, attr, None) == width:
            setattr(module, attr, cast(int, width) // tp)
    fused = [child for child, style in entries.items() if parent_name(child) == name and style in PACKED_PARTS]
    if fused and isinstance(split_size := getattr(module, "split_size", None), int):
        setattr(module, "split_size", split_size // tp)


def _gather_sequence(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """One all-gather of the sequence-sharded input for a whole attention/MLP module."""
    return tuple(gather_sequence(a) for a in args), {k: gather_sequence(v) for k, v in kwargs.items()}


def _map_first(args: tuple, kwargs: dict, fn) -> tuple[tuple, dict]:
    """Apply ``fn`` to the first positional argument, or to the first keyword argument if there is none."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    if kwargs:
        first = next(iter(kwargs))
        return args, {**kwargs, first: fn(kwargs[first])}
    return args, kwargs


def _replicate_first_input(tp_mesh: DeviceMesh):
    """Pre-hook: the module's (replicated) hidden-state input becomes one Replicate DTensor (no comm)."""

    def to_replicate(value: object) -> object:
        if is_plain_float(value):
            return DTensor.from_local(value, tp_mesh, [Replicate()], run_check=False)
        return value

    return lambda module, args, kwargs: _map_first(args, kwargs, to_replicate)


def _enter_sequence_parallel(tp_mesh: DeviceMesh):
    """Pre-hook for every block: a replicated residual input becomes sequence-sharded (a local slice, no comm)."""

    def to_shard(value: object) -> object:
        if is_plain_float(value):
            full = DTensor.from_local(value, tp_mesh, [Replicate()], run_check=False)
            return full.redistribute(placements=[Shard(SEQUENCE_DIM)])
        return value

    return lambda module, args, kwargs: _map_first(args, kwargs, to_shard)


def _run_whole_under_sp(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """A whole module inside a block under SP (or one split module that works on its plain input, RWKV's) gets the
    full sequence as a plain tensor for its own layers, and hands back its output's sequence shard; only when it
    was given a sequence shard (a module fed positions or ids, whose output is not on the sequence, is left
    alone)."""
    gathered = [False]

    def gather(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        gathered[0] = any(isinstance(value, DTensor) for value in (*args, *kwargs.values()))
        args, kwargs = _gather_sequence(module, args, kwargs)
        plain = lambda value: value.to_local() if isinstance(value, DTensor) else value  # noqa: E731
        return tuple(plain(a) for a in args), {k: plain(v) for k, v in kwargs.items()}

    def shard(module: nn.Module, args: tuple, output: object) -> object:
        to_shard = lambda value: DTensor.from_local(value, tp_mesh, [Replicate()], run_check=False).redistribute(  # noqa: E731
            placements=[Shard(SEQUENCE_DIM)]) if gathered[0] and is_plain_float(value) else value
        return (to_shard(output[0]), *output[1:]) if isinstance(output, tuple) else to_shard(output)

    module.register_forward_pre_hook(gather, with_kwargs=True)
    module.register_forward_hook(shard)


def _leave_sequence_parallel(module: nn.Module, args: tuple, output: object) -> object:
    """Post-hook on the last module of the region: later modules get a plain, full tensor."""
    full = lambda value: value.full_tensor() if isinstance(value, DTensor) else value  # noqa: E731
    if isinstance(output, tuple):
        return (full(output[0]), *output[1:])
    return full(output)
