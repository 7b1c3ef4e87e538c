"""How many operations one training micro-step runs eagerly: ``count_ops(model, blocks, seq_len)``, counted, not
guessed.

On a small model the eager overhead of each operation (Python, the dispatcher, autograd), not its arithmetic, sets
the step time: the example GPT's step on 4 CPU processes does about 150 MFLOP in over 200 ms. A step model that
prices operations needs their number, which depends on how the model's code is written (a fused projection is one
operation, three projections are three), so it is read from the model itself: its forward and backward run once on
a meta-device copy (no memory, no arithmetic) under a dispatch mode that counts every aten operation, the forward's
split by module hooks into the blocks and the rest. The backward's operations are split between them in the
forward's proportion. A model whose forward cannot run on the meta device (a data-dependent MoE dispatch: which
experts get rows is known only from the router's values) runs instead on a CPU copy filled with small random values
and fed random token ids, when it has at most `CPU_COUNT_PARAMS` parameters, with enough tokens that every expert
gets rows as in a training step; a larger one gives `None`, and the caller falls back to its own estimate and says
so. The operations inside stacked experts are also counted apart (`OpCount.expert_ops`), as expert parallelism runs
only a rank's share of them.
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
CPU_COUNT_PARAMS = 20_000_000
"""The largest model counted on a CPU copy (80 MB in float32) when its forward does not run on the meta device."""
CPU_COUNT_TOKENS = 256
"""Tokens of a CPU count: 256 x top-k rows spread by a random router give every one of 64 experts rows (the
examples' MoE: 8), so the experts' loop runs as often as in a step; fewer experts would get rows at 8."""


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
    expert_ops: tuple[int, ...] = ()
    """Of ``per_block``, the operations inside each block's stacked experts (0 in a block without them)."""

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
        self.experts: list[bool] = [False]
        self.expert_forward: dict[int, int] = {}
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
            if self.experts[-1]:
                self.expert_forward[where] = self.expert_forward.get(where, 0) + 1
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


def _enter(counter: _Counter, index: int, experts: bool, *_: Any) -> None:
    counter.where.append(index)
    counter.experts.append(experts or counter.experts[-1])


def _leave(counter: _Counter, *_: Any) -> None:
    counter.where.pop()
    counter.experts.pop()


def count_ops(model: nn.Module, blocks: Sequence[str], seq_len: int = COUNT_TOKENS) -> OpCount | None:
    """The operations ``model`` runs in one forward and backward on one row of ``seq_len`` token ids, by block,
    and the bytes per token its memory-bound ones move (the difference of a second run at twice the tokens);
    on a CPU copy where its forward does not run on the meta device (see the module's docstring), else None."""
    meta = _copy_to(model, "meta")
    counted = _count(meta, blocks, seq_len) if meta is not None else None
    if counted is not None or sum(p.numel() for p in model.parameters()) > CPU_COUNT_PARAMS:
        return counted
    cpu = _copy_to(model, "cpu")
    return _count(cpu, blocks, max(seq_len, CPU_COUNT_TOKENS)) if cpu is not None else None


def _copy_to(model: nn.Module, device: str) -> nn.Module | None:
    """A copy of ``model`` on ``device`` (on the CPU: parameters drawn from normal(0, 0.02), seeded, so a router
    spreads its tokens; buffers zero, so an expert bias does not steer them); None when an attribute cannot be
    copied."""
    generator = torch.Generator().manual_seed(0)

    def fill(tensor: torch.Tensor, draw: bool) -> torch.Tensor:
        empty = torch.empty_like(tensor, device=device)
        if device == "meta":
            return empty
        return empty.normal_(0.0, 0.02, generator=generator) if draw and empty.is_floating_point() else empty.zero_()

    memo: dict[int, Any] = {id(p): nn.Parameter(fill(p, True), requires_grad=p.is_floating_point())
                            for p in model.parameters()}
    memo |= {id(b): fill(b, False) for b in model.buffers()}
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # an attribute deepcopy cannot copy: no count
        return None


def _count(copied: nn.Module, blocks: Sequence[str], seq_len: int) -> OpCount | None:
    from lightning_nd.model.structure import is_experts

    counter = _Counter()
    handles = []
    for index, name in enumerate(blocks):
        for module in copied.get_submodule(name).modules():  # a block that is a list is never called itself
            handles.append(module.register_forward_pre_hook(
                functools.partial(_enter, counter, index, is_experts(module))))
            handles.append(module.register_forward_hook(functools.partial(_leave, counter)))
    try:
        runs = []
        for tokens in (seq_len, 2 * seq_len):
            counter.reset()
            _forward_backward(copied, counter, tokens)
            scale = _with_backward(counter.forward, counter.backward)
            runs.append((_split(counter.forward, counter.backward, len(blocks)),
                         _split(counter.forward_bytes, counter.backward_bytes, len(blocks)),
                         [counter.expert_forward.get(index, 0) * scale for index in range(len(blocks))]))
    except Exception:  # no meta kernel (`nonzero`, `.item()`): counted on the CPU or estimated by the caller
        return None
    finally:
        for handle in handles:
            handle.remove()
    ((ops, outside), (block_bytes, outside_bytes), experts), (_, (more_block_bytes, more_outside_bytes), _) = runs
    return OpCount(tuple(round(n) for n in ops), round(outside),
                   tuple(max(b - a, 0) / seq_len for a, b in zip(block_bytes, more_block_bytes)),
                   max(more_outside_bytes - outside_bytes, 0) / seq_len,
                   tuple(round(n) for n in experts) if any(experts) else ())


def _forward_backward(copied: nn.Module, counter: _Counter, seq_len: int) -> None:
    for parameter in copied.parameters():
        parameter.grad = None  # each run's backward writes its gradients anew, as a step's first micro-batch does
    device = next(copied.parameters()).device
    vocab = min((m.num_embeddings for m in copied.modules() if isinstance(m, nn.Embedding)), default=1)
    tokens = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    with counter:
        output = copied(tokens)
        output = output.logits if hasattr(output, "logits") else output
        output = output[0] if isinstance(output, (tuple, list)) else output
        loss = output.float().sum()
        counter.in_backward = True
        loss.backward()


def _split(forward: dict[int, int], backward: int, blocks: int) -> tuple[list[float], float]:
    """Each block's and the rest's forward count with the backward's split between them as the forward's was."""
    scale = _with_backward(forward, backward)
    return [forward.get(index, 0) * scale for index in range(blocks)], forward.get(-1, 0) * scale


def _with_backward(forward: dict[int, int], backward: int) -> float:
    """What a forward count becomes with its share of the backward's (which hooks cannot place): 1 + backward over
    the whole forward."""
    total = sum(forward.values())
    return 1 + (backward / total if total else 0.0)


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
