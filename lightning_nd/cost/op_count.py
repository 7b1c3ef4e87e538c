"""How many operations one training micro-step runs eagerly: ``count_ops(model, blocks, seq_len)``, counted, not
guessed.

On a small model the eager overhead of each operation (Python, the dispatcher, autograd), not its arithmetic, sets
the step time: the example GPT's step on 4 CPU processes does about 150 MFLOP in over 200 ms. A step model that
prices operations needs their number, which depends on how the model's code is written (a fused projection is one
operation, three projections are three), so it is read from the model itself: its forward and backward run once on
a meta-device copy (no memory, no arithmetic) under a dispatch mode that counts every aten operation, the forward's
split by module hooks into the blocks and the rest. The backward's operations are split between them in the
forward's proportion. A model whose forward cannot run on the meta device (a data-dependent MoE dispatch) gives
`None`: the caller falls back to its own estimate and says so.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

COUNT_TOKENS = 8
"""Tokens of the counted forward: operation counts do not grow with the sequence, only sizes do."""


@dataclass(frozen=True)
class OpCount:
    """Aten operations of one forward and backward of one micro-batch."""

    per_block: tuple[int, ...]
    """Each block's, forward and backward, in block order."""
    outside: int
    """The rest of the model's (embedding, final norm, head, loss), forward and backward."""

    @property
    def total(self) -> int:
        return sum(self.per_block) + self.outside


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.where: list[int] = [-1]
        self.forward: dict[int, int] = {}
        self.backward = 0
        self.in_backward = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.in_backward:
            self.backward += 1
        else:
            self.forward[self.where[-1]] = self.forward.get(self.where[-1], 0) + 1
        return func(*args, **(kwargs or {}))


def _enter(counter: _Counter, index: int, *_: Any) -> None:
    counter.where.append(index)


def _leave(counter: _Counter, *_: Any) -> None:
    counter.where.pop()


def count_ops(model: nn.Module, blocks: Sequence[str], seq_len: int = COUNT_TOKENS) -> OpCount | None:
    """The operations ``model`` runs in one forward and backward on one row of ``seq_len`` token ids, by block;
    None when its forward or backward does not run on the meta device."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.is_floating_point())
                            for p in model.parameters()}
    memo |= {id(b): torch.empty_like(b, device="meta") for b in model.buffers()}
    try:
        meta = copy.deepcopy(model, memo)
    except Exception:  # an attribute deepcopy cannot copy: no count
        return None
    counter = _Counter()
    handles = []
    for index, name in enumerate(blocks):
        for module in meta.get_submodule(name).modules():  # a block that is a list is never called itself
            handles.append(module.register_forward_pre_hook(functools.partial(_enter, counter, index)))
            handles.append(module.register_forward_hook(functools.partial(_leave, counter)))
    tokens = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    try:
        with counter:
            output = meta(tokens)
            output = output.logits if hasattr(output, "logits") else output
            output = output[0] if isinstance(output, (tuple, list)) else output
            loss = output.float().sum()
            counter.in_backward = True
            loss.backward()
    except Exception:  # no meta kernel (`nonzero`, `.item()`): the caller estimates instead
        return None
    finally:
        for handle in handles:
            handle.remove()
    forward = [counter.forward.get(index, 0) for index in range(len(blocks))]
    outside = counter.forward.get(-1, 0)
    total_forward = sum(forward) + outside
    ratio = counter.backward / total_forward if total_forward else 0.0
    return OpCount(tuple(round(ops * (1 + ratio)) for ops in forward), round(outside * (1 + ratio)))


def count_model_ops(module: nn.Module) -> OpCount | None:
    """`count_ops` of the network inside ``module`` (a LightningModule or a holder: the attribute holding its
    blocks; a bare model: itself), its blocks found as the planner finds them."""
    from lightning_nd.model.structure import find_blocks

    names = [name for name, _ in find_blocks(module)]
    if not names:
        return None
    head, _, rest = names[0].partition(".")
    owner = getattr(module, head, None)
    if rest and isinstance(owner, nn.Module) and all(name.startswith(head + ".") for name in names) and (
            type(module).forward is nn.Module.forward or not _takes_tokens(module)):
        return count_ops(owner, [name[len(head) + 1:] for name in names])
    return count_ops(module, names)


def _takes_tokens(module: nn.Module) -> bool:
    """Whether ``module``'s forward is a network's (it is not a LightningModule, whose forward is the user's)."""
    return not any(cls.__name__ == "LightningModule" for cls in type(module).__mro__)
