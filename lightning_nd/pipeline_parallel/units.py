"""A model's pipeline units in order: the modules its forward calls before the repeated blocks, the blocks, and those
it calls after them.

The units are the outermost modules outside the blocks that own parameters (embeddings, final norm, head). Their order
comes from the model's declared plan (Hugging Face ``_pp_plan`` / ``config.base_model_pp_plan``), else from its
forward, run once on the meta device (`forward_trace.py`): the order of registration need not be the forward's
(LitGPT's ``GPT`` registers ``lm_head`` before ``transformer.wte``). Only where the forward cannot run there (it
needs inputs other than token ids, or values) does registration order decide.

Every stage runs the model's own forward on the model's inputs (`stage.py`), so what the forward computes from them
and from buffers (rope tensors, masks, positions) is computed again on each stage. What a stage receives from the
one before is the hidden states alone, and its forward loops over the blocks it holds alone: the trace refuses by
name a block argument computed from weights, hidden states changed between two blocks, a unit after the blocks that
reads a weight of one before them, and a block argument that changes when earlier blocks are not there (read by the
block's position among those held).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from torch import nn

from lightning_nd.model.structure import get_submodule
from lightning_nd.pipeline_parallel.forward_trace import (
    Call,
    ForwardTrace,
    NoTrace,
    hidden_argument,
    main_output,
    tensor_arguments,
    trace_forward,
    weights_reached,
)

PP1 = "or train this model with pp=1"


def pipeline_units(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> tuple[list[str], list[str], list[str], str]:
    """(units before the blocks, block names, units after them, where that came from)."""
    declared = getattr(model, "_pp_plan", None) or getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    names = [name for name, _ in model.named_modules()]
    if isinstance(declared, Mapping) and declared:
        containers = [key for key in declared if isinstance(get_submodule(model, key), (nn.ModuleList, nn.ModuleDict))]
        if len(containers) == 1 and all(key in names for key in declared):
            container = containers[0]
            block_names = [f"{container}.{child}" for child, _ in get_submodule(model, container).named_children()]
            order = {name: index for index, name in enumerate(names)}
            others = sorted((key for key in declared if key != container), key=order.__getitem__)
            pre = [key for key in others if order[key] < order[container]]
            post = [key for key in others if order[key] > order[container]]
            missing = [name for name in _owners(model, block_names) if not name.startswith(tuple(u + "." for u in others))
                       and name not in others]
            if missing:
                raise ValueError(
                    f"The model's declared pipeline plan (`{_plan_name(model)}`) leaves out `{missing[0]}`, which owns"
                    " parameters: every stage would hold its own copy. HINT: pass `NDParallel(block_classes=[...])`"
                    " and remove the plan from the model to split by its forward, or add the module to the plan."
                )
            return pre, block_names, post, f"the model's declared plan (`{_plan_name(model)}`)"
    block_names = [name for name, _ in blocks]
    if not block_names:
        raise ValueError(
            f"Pipeline parallelism splits a model between its repeated blocks, and none were found in"
            f" `{type(model).__name__}`. HINT: pass `NDParallel(block_classes=[YourBlock])`."
        )
    owners = _owners(model, block_names)
    try:
        trace = trace_forward(model, owners, block_names)
    except NoTrace as failed:
        pre, post = _by_registration(names, owners, block_names)
        return pre, block_names, post, f"registration order (the forward did not run on the meta device: {failed})"
    pre, post = _by_forward(model, trace, names, owners, block_names)
    return pre, block_names, post, "the order the model's forward calls its units (one forward on the meta device)"


def _by_registration(names: list[str], owners: list[str], block_names: list[str]) -> tuple[list[str], list[str]]:
    first, last = names.index(block_names[0]), names.index(block_names[-1])
    middle = [name for name in owners if first < names.index(name) < last]
    if middle:
        raise ValueError(f"`{middle[0]}` owns parameters and sits between the repeated blocks, so no stage boundary"
                         " is clean. HINT: give its parameters to a block, or pass `block_classes=` naming the blocks.")
    return ([name for name in owners if names.index(name) < first],
            [name for name in owners if names.index(name) > last])


def _by_forward(model: nn.Module, trace: ForwardTrace, names: list[str], owners: list[str],
                block_names: list[str]) -> tuple[list[str], list[str]]:
    """Units before and after the blocks as the forward calls them (one never called: by where it is registered),
    once the blocks are found called once each, in order, and what they hand on found carried."""
    model_name = type(model).__name__
    called = [call for call in trace.calls if call.name in block_names]
    if [call.name for call in called] != block_names:
        raise ValueError(
            f"`{model_name}`'s forward calls its blocks as {_listed([call.name for call in called])}, not once each in"
            f" the order they are registered ({_listed(block_names)}); pipeline stages hold contiguous runs of them."
            f" HINT: pass `NDParallel(block_classes=[...])` naming modules called once each in order, {PP1}."
        )
    begin, finish = called[0].start, called[-1].end
    unused_pre, unused_post = _by_registration(names, [u for u in owners if not _calls(trace, u)], block_names)
    pre: list[str] = []
    post: list[str] = []
    for unit in sorted((u for u in owners if _calls(trace, u)), key=lambda u: _calls(trace, u)[0].start):
        sides = {"before" if call.end < begin else "after" if call.start > finish else "between"
                 for call in _calls(trace, unit)}
        if "between" in sides:
            raise ValueError(
                f"`{unit}` owns parameters and `{model_name}`'s forward calls it between its first and its last block"
                f" (or runs the blocks inside it), so no stage boundary is clean. HINT: give its parameters to a block,"
                f" or pass `block_classes=` naming the blocks."
            )
        if sides == {"before", "after"}:
            raise ValueError(
                f"`{model_name}`'s forward calls `{unit}` both before and after its blocks, and a pipeline stage holds"
                f" it once: on the first stage or on the last. HINT: use one module before the blocks and another"
                f" after them, {PP1}."
            )
        (pre if sides == {"before"} else post).append(unit)
    _check_blocks_carried(model_name, trace, called)
    _check_after_blocks(model_name, trace, called[-1], [*post, *unused_post])
    _check_positions(model, owners, block_names, called)
    return [*pre, *unused_pre], [*post, *unused_post]


def _check_blocks_carried(model_name: str, trace: ForwardTrace, called: list[Call]) -> None:
    """A stage may start at any block but the first, and receives nothing but the hidden states: each block must be
    called on what the block before it returned, and with nothing else computed from weights."""
    for before, call in itertools.pairwise(called):
        previous = main_output(before.output)
        hidden = hidden_argument(call.args, call.kwargs, previous)
        value = call.args[0] if hidden == "0" else call.kwargs.get(hidden) if hidden is not None else None
        if value is not previous:
            raise ValueError(
                f"`{model_name}`'s forward does not call `{call.name}` on what `{before.name}` returned, and a"
                f" pipeline stage starting at `{call.name}` would receive exactly that. HINT: move what happens"
                f" between the blocks into them, {PP1}."
            )
        for argument, tensor in tensor_arguments(call.args, call.kwargs):
            if argument == hidden:
                continue
            outside = [name for weight in weights_reached(tensor) for name in trace.weights.get(id(weight), [])
                       if not name.startswith(call.name + ".")]
            if outside:
                raise ValueError(
                    f"`{model_name}`'s forward calls `{call.name}` with {_argument(argument)} computed from the weight"
                    f" `{outside[0]}`. A pipeline stage receives only the hidden states from the stage before it and"
                    f" computes everything else again from the model's inputs and buffers, so a stage starting at"
                    f" `{call.name}` could not compute it. HINT: compute it inside the blocks, {PP1}."
                )


def _check_after_blocks(model_name: str, trace: ForwardTrace, last: Call, post: list[str]) -> None:
    """The last stage holds the units after the blocks and receives the last block's output: what they and the
    model's output are computed from must be that, the model's inputs and buffers, and their own weights."""
    stop = main_output(last.output)
    after = [(f"`{call.name}`", call.args, call.kwargs) for call in trace.calls if call.start > last.end]
    for reader, args, kwargs in [*after, ("the model's output", (main_output(trace.output),), {})]:
        for _, tensor in tensor_arguments(args, kwargs):
            for weight in weights_reached(tensor, stop):
                weight_names = trace.weights.get(id(weight), [])
                if weight_names and not any(name.startswith(tuple(unit + "." for unit in post)) for name in weight_names):
                    raise ValueError(
                        f"In `{model_name}`'s forward, {reader} reads the weight `{weight_names[0]}` other than through"
                        f" the last block's output, and the last pipeline stage holds the units after the blocks but"
                        f" receives only that output from the stage before it. HINT: compute that inside the blocks, {PP1}."
                    )


def _check_positions(model: nn.Module, owners: list[str], block_names: list[str], called: list[Call]) -> None:
    """A stage's forward loops over the blocks it holds alone: what it hands each block besides the hidden states must
    be what the whole model hands it, not something read by the block's position among those held or by their
    number. Compared with a second trace holding the blocks from the second on, as a stage starting there does."""
    if len(block_names) < 2:
        return
    model_name, start = type(model).__name__, block_names[1]
    try:
        later = trace_forward(model, owners, block_names, held=block_names[1:])
    except NoTrace as failed:
        raise ValueError(
            f"`{model_name}`'s forward fails without the blocks before `{start}`, as on a pipeline stage starting"
            f" there ({failed}). HINT: let the forward loop over whatever blocks the model holds, {PP1}."
        ) from failed
    alone = {call.name: call for call in later.calls if call.name in block_names}
    for before, call in itertools.pairwise(called):
        hidden = hidden_argument(call.args, call.kwargs, main_output(before.output))
        there = alone[call.name].recipes if call.name in alone else {}
        changed = [key for key in {**call.recipes, **there} if key != hidden and call.recipes.get(key) != there.get(key)]
        if changed:
            raise ValueError(
                f"`{model_name}`'s forward hands `{call.name}` {_argument(changed[0])} that changes when the blocks"
                f" before `{start}` are not there, as on a pipeline stage starting at `{start}`: it is read by the"
                f" block's position among the blocks held, or from their number. HINT: read it inside each block from"
                f" the block's own index, {PP1}."
            )


def _calls(trace: ForwardTrace, name: str) -> list[Call]:
    return [call for call in trace.calls if call.name == name]


def _argument(key: str) -> str:
    return f"its positional argument {key}" if key.isdigit() else f"`{key}=`"


def _listed(names: list[str]) -> str:
    shown = ", ".join(f"`{name}`" for name in names[:4])
    return shown + (f" ... ({len(names)} calls)" if len(names) > 4 else "") if names else "none"


def _owners(model: nn.Module, block_names: list[str]) -> list[str]:
    """The outermost modules outside the blocks that own parameters themselves."""
    inside = tuple(name + "." for name in block_names)
    owners = [
        name for name, module in model.named_modules()
        if name and not name.startswith(inside) and name not in block_names
        and any(True for _ in module.parameters(recurse=False))
    ]
    return [name for name in owners if not any(name.startswith(other + ".") for other in owners)]


def _plan_name(model: nn.Module) -> str:
    return "_pp_plan" if getattr(model, "_pp_plan", None) else "config.base_model_pp_plan"
