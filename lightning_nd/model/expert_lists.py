"""Experts kept as a list of modules: a ``ModuleList`` of identical MLPs beside the gate that scores them, in a block
whose own forward routes (LitGPT's ``LLaMAMoE``, the Mixtral and DeepSeek MoE blocks of transformers 4 and of
remote code). Found by structure, not by class name:

- the list holds two or more modules of one class with the same parameter names and shapes, every parameter in a
  linear layer, one of them reading the residual width ``H`` and one writing it (each expert maps ``H -> H``);
- a sibling scores them: a linear layer ``H -> E`` (LitGPT's ``gate``), or a module with a ``weight [E, H]`` of its
  own (a router such as LitGPT's ``GroupedTopkRouter`` or DeepSeek's ``MoEGate``).

The block's forward is the model's own: expert parallelism keeps it (`lightning_nd.expert_parallel.lists`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from lightning_nd.model.structure import is_linear, widths


@dataclass(frozen=True)
class ExpertList:
    """One block's experts held in a list."""

    name: str
    """The ``ModuleList``."""
    block: str
    """Its parent: the module whose forward routes the tokens and calls the experts."""
    gate: str
    """The sibling that scores the experts."""
    count: int
    hidden: int


def expert_lists(model: nn.Module) -> list[ExpertList]:
    """Every expert list of ``model``, in module order."""
    found = []
    for block_name, block in model.named_modules():
        for child, experts in block.named_children():
            if not isinstance(experts, nn.ModuleList):
                continue
            gate = _gate(block, child, len(experts), _mlp_widths(experts))
            if gate is not None:
                prefix = f"{block_name}." if block_name else ""
                found.append(ExpertList(prefix + child, block_name, prefix + gate[0], len(experts), gate[1]))
    return found


def _mlp_widths(experts: nn.ModuleList) -> set[int]:
    """The widths each expert both reads and writes, when ``experts`` are two or more identical MLPs (every
    parameter in a linear layer), else none."""
    members = list(experts.children())  # by position: a pipeline stage's list of blocks keeps only its own indices
    shapes = [(type(expert), [(name, p.shape) for name, p in expert.named_parameters()]) for expert in members]
    if len(shapes) < 2 or any(shape != shapes[0] for shape in shapes) or not shapes[0][1]:
        return set()
    owners = [module for module in members[0].modules() if any(True for _ in module.parameters(recurse=False))]
    if len(owners) < 2 or not all(is_linear(module) for module in owners):
        return set()
    return {widths(module)[0] for module in owners} & {widths(module)[1] for module in owners}


def _gate(block: nn.Module, experts: str, count: int, hidden: set[int]) -> tuple[str, int] | None:
    """The one sibling of ``experts`` that scores ``count`` experts from a width they read and write, and that width:
    a linear layer, or a module of no children with a ``weight [count, H]`` of its own."""
    found = []
    for name, module in block.named_children():
        weight = module._parameters.get("weight")
        if name == experts or not isinstance(weight, Tensor) or weight.ndim != 2:
            continue
        if is_linear(module):
            width, out = widths(module)
        elif not any(True for _ in module.children()):
            out, width = weight.shape
        else:
            continue
        if out == count and width in hidden:
            found.append((name, width))
    return found[0] if len(found) == 1 else None
