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
    """Aten operations of one forward and backward of one micro-batch, and the bytes the memory-bound ones move."""

    per_block: tuple[int, ...]
    """Each block's, forward and backward, in block order."""
    outside: int
    """The rest of the model's (embedding, final norm, head, loss), forward and backward."""
    bytes_per_token: tuple[float, ...] = ()
    """Each block's bytes read and written per token by its operations other than matmuls and attention, forward
    and backward: what grows with the tokens (views and the weights' own updates excluded)."""
    outside_bytes_per_token: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.per_block) + self.outside


COMPUTE_BOUND = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product", "scaled_dot_product",
                 "convolution", "embedding_dense_backward")
"""Operations priced by their arithmetic (matmuls) or on their own (attention), not by the bytes they move."""


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def reset(self) -> None:
        self.where: list[int] = [-1]
        self.forward: dict[int, int] = {}
        self.forward_bytes: dict[int, int] = {}
        self.backward = 0
        self.backward_bytes = 0
        self.in_backward = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        moved = _bytes_moved(func, args, kwargs, result)
        if self.in_backward:
            self.backward += 1
            self.backward_bytes += moved
        else:
            where = self.where[-1]
            self.forward[where] = self.forward.get(where, 0) + 1
            self.forward_bytes[where] = self.forward_bytes.get(where, 0) + moved
        return result


def _bytes_moved(func: Any, args: tuple, kwargs: dict | None, result: Any) -> int:
    """Bytes a memory-bound operation reads (its tensor inputs) and writes (its outputs); 0 for a view or a
    compute-bound operation."""
    name = func.__name__ if hasattr(func, "__name__") else str(func)
    if getattr(func, "is_view", False) or any(name.startswith(prefix) for prefix in COMPUTE_BOUND):
        return 0
    tensors = [t for t in (*args, *(kwargs or {}).values(), *(result if isinstance(result, (tuple, list)) else
                                                               (result,))) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _enter(counter: _Counter, index: int, *_: Any) -> None:
    counter.where.append(index)


def _leave(counter: _Counter, *_: Any) -> None:
    counter.where.pop()


def count_ops(model: nn.Module, blocks: Sequence[str], seq_len: int = COUNT_TOKENS) -> OpCount | None:
    """The operations ``model`` runs in one forward and backward on one row of ``seq_len`` token ids, by block,
    and the bytes per token its memory-bound ones move (the difference of a second run at twice the tokens);
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
    try:
        runs = []
        for tokens in (seq_len, 2 * seq_len):
            counter.reset()
            _forward_backward(meta, counter, tokens)
            runs.append((_split(counter.forward, counter.backward, len(blocks)),
                         _split(counter.forward_bytes, counter.backward_bytes, len(blocks))))
    except Exception:  # no meta kernel (`nonzero`, `.item()`): the caller estimates instead
        return None
    finally:
        for handle in handles:
            handle.remove()
    ((ops, outside), (block_bytes, outside_bytes)), (_, (more_block_bytes, more_outside_bytes)) = runs
    return OpCount(tuple(round(n) for n in ops), round(outside),
                   tuple(max(b - a, 0) / seq_len for a, b in zip(block_bytes, more_block_bytes)),
                   max(more_outside_bytes - outside_bytes, 0) / seq_len)


def _forward_backward(meta: nn.Module, counter: _Counter, seq_len: int) -> None:
    for parameter in meta.parameters():
        parameter.grad = None  # each run's backward writes its gradients anew, as a step's first micro-batch does
    tokens = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    with counter:
        output = meta(tokens)
        output = output.logits if hasattr(output, "logits") else output
        output = output[0] if isinstance(output, (tuple, list)) else output
        loss = output.float().sum()
        counter.in_backward = True
        loss.backward()


def _split(forward: dict[int, int], backward: int, blocks: int) -> tuple[list[float], float]:
    """Each block's and the rest's forward count with the backward's split between them as the forward's was."""
    per_block = [forward.get(index, 0) for index in range(blocks)]
    outside = forward.get(-1, 0)
    total = sum(per_block) + outside
    scale = 1 + (backward / total if total else 0.0)
    return [n * scale for n in per_block], outside * scale


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
