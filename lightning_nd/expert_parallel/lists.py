"""Expert parallelism for experts kept in a list (`lightning_nd.model.expert_lists`: LitGPT's ``LLaMAMoE``, the
Mixtral and DeepSeek blocks of transformers 4): each rank of an ep group holds E/ep of the list's experts under their
own indices (``experts.2.fc_1.weight`` keeps its name), and the block's own forward keeps routing.

The block calls its experts one by one, each on its tokens' rows, and uses each answer at once, while a dispatch
needs every expert's rows before the first answer. So the block's forward runs twice (`TwoPassBlock`):

1. the routing pass: each expert called answers zeros and its rows are kept; then one all-to-all takes all of them
   to their experts' ranks, each rank runs its experts (`ListedExperts.forward`), one all-to-all brings the answers
   back;
2. the pass whose output the block returns: the same calls, each given its answer.

Both are the model's code, from the same random state (routing that draws, draws alike), and only the second is
counted by the `RoutingMonitor` (the first is a trial forward, `lightning_nd.runtime.trial`). The second checks each
call against the first (expert and rows) and refuses a difference. The answers are computed from the first pass's
rows, the same values as the second's: their gradient reaches the block's input through the first pass's indexing,
and the gate's through the second pass's routing weights. What it costs: the block's code beside the experts (gate,
top-k, shared experts) runs twice in forward; the first pass's output is dropped with what it kept for backward,
but for the rows.

Gradients: an expert's gradient sums what every rank of its ep group sent it; ``grad_scale`` (1/ep, set by the
composer) scales it as `lightning_nd.expert_parallel.dispatch` does, the rows' gradient left as it is.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from itertools import accumulate
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_nd.expert_parallel.communication import ScaleGrad, all_to_all_rows, exchange_counts
from lightning_nd.model.expert_lists import expert_lists
from lightning_nd.runtime.clip import HELD_BY_ONE_EP_RANK_OF
from lightning_nd.runtime.trial import trial_forward

HINT = "HINT: use ep=1 for this model."
T = TypeVar("T")


class ListedExperts(nn.Module):
    """This rank's experts of one list, standing in for the whole list: it has the list's length, and its items, one
    per expert, called as the block calls an expert, take part in the dispatch."""

    def __init__(self, experts: nn.ModuleList, mesh: DeviceMesh, hidden: int, name: str) -> None:
        """``mesh``: the 1-D ep mesh; ``hidden``: the width each expert reads and writes; ``name``: the list's."""
        super().__init__()
        self.group = mesh.get_group()
        self.size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.count, self.hidden, self.list_name = len(experts), hidden, name
        assert self.count % self.size == 0, "the plan checks that ep divides every expert list"
        self.local = self.count // self.size
        self.first = rank * self.local
        for index in range(self.first, self.first + self.local):
            self.add_module(str(index), experts[index])
        self.slots = tuple(_Slot(self, index) for index in range(self.count))
        self.grad_scale = 1.0
        self._mode: str | None = None
        self._calls: list[tuple[int, Tensor]] = []
        self._answers: list[Tensor] = []
        self._answered = 0

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[_Slot]:
        return iter(self.slots)

    def __getitem__(self, index: int | slice) -> Any:
        return self.slots[index] if isinstance(index, slice) else self.slots[operator.index(index)]

    def elsewhere(self) -> list[str]:
        """The indices of the experts other ep ranks hold."""
        return [str(index) for index in range(self.count) if not self.first <= index < self.first + self.local]

    def called(self, index: int, args: tuple, kwargs: Mapping[str, Any]) -> Tensor:
        if len(args) != 1 or kwargs or not isinstance(args[0], Tensor) or args[0].shape[-1] != self.hidden:
            raise TypeError(f"Under expert parallelism an expert of `{self.list_name}` takes one tensor of rows"
                            f" [..., {self.hidden}]; it was called with {len(args)} positional and {len(kwargs)}"
                            f" keyword arguments. {HINT}")
        rows = args[0]
        if self._mode == "routing":
            self._calls.append((index, rows))
            return torch.zeros_like(rows)
        if self._mode != "answering":
            raise RuntimeError(f"An expert of `{self.list_name}` was called outside its block's forward: under expert"
                               " parallelism each rank holds some of the experts, and they run through the block."
                               " HINT: call the block that holds them.")
        position = self._answered
        first = self._calls[position] if position < len(self._calls) else None
        if first is None or first[0] != index or first[1].shape != rows.shape:
            was = f"expert {first[0]} with rows {tuple(first[1].shape)}" if first else "no call"
            raise RuntimeError(f"The block of `{self.list_name}` routed differently in the two passes expert"
                               f" parallelism runs it: its call {position + 1} went to expert {index} with rows"
                               f" {tuple(rows.shape)}, and in the first pass to {was}. Its routing must depend only on"
                               f" its input and the random state. {HINT}")
        self._answered += 1
        return self._answers[position]

    @contextmanager
    def routing(self) -> Iterator[None]:
        """The first pass: its calls are kept; then their rows travel to their experts and the answers back."""
        self._mode, self._calls = "routing", []
        cuda = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
        try:
            with torch.random.fork_rng(devices=cuda):  # restored after the experts ran too: their dropout draws as well
                with trial_forward():
                    yield
                self._mode = None
                self._answers = self._dispatch()
        finally:
            self._mode = None

    @contextmanager
    def answering(self) -> Iterator[None]:
        """The second pass: each call is given its answer."""
        self._mode, self._answered = "answering", 0
        try:
            yield
        finally:
            self._mode, calls, answered = None, len(self._calls), self._answered
            self._calls, self._answers = [], []
        if answered != calls:
            raise RuntimeError(f"The block of `{self.list_name}` called its experts {calls} times in the first pass"
                               f" expert parallelism runs it and {answered} in the second. {HINT}")

    def _dispatch(self) -> list[Tensor]:
        """The kept calls' rows, grouped by expert (each rank's share contiguous), to their experts' ranks and back:
        the answers, in call order."""
        calls = self._calls
        order = sorted(range(len(calls)), key=lambda call: calls[call][0])
        rows = [calls[call][1].reshape(-1, self.hidden) for call in order]
        counts = [0] * self.count
        for call, piece in zip(order, rows):
            counts[calls[call][0]] += piece.shape[0]
        if rows:
            sent = torch.cat(rows)
        else:  # no token here: this rank still joins the all-to-alls
            param = next(self.parameters())
            sent = torch.zeros(0, self.hidden, dtype=param.dtype, device=param.device)
        per_rank = torch.tensor(counts, device=sent.device).view(self.size, self.local)
        received = exchange_counts(per_rank, self.group)
        send_splits, recv_splits = per_rank.sum(1).tolist(), received.sum(1).tolist()
        arrived = all_to_all_rows(sent, send_splits, recv_splits, self.group)
        back = all_to_all_rows(self(arrived, received), recv_splits, send_splits, self.group)
        answers = [back] * len(calls)
        for call, answer in zip(order, back.split([piece.shape[0] for piece in rows])):
            answers[call] = answer.view(calls[call][1].shape)
        return answers

    def forward(self, rows: Tensor, counts: Tensor) -> Tensor:
        """``rows`` from every sender, grouped by sender, then by local expert (``counts [sender, local expert]``) ->
        each row's answer in its place. Every expert runs, on no rows too, so each holds a gradient on every rank
        (FSDP reduces them together)."""
        flat = counts.flatten().tolist()
        starts = [0, *accumulate(flat)]
        output = torch.zeros_like(rows)
        for local, expert in enumerate(self.children()):
            at = [sender * self.local + local for sender in range(self.size)]
            chosen = torch.cat([torch.arange(starts[i], starts[i] + flat[i], device=rows.device) for i in at])
            given = rows[chosen]
            if self.grad_scale != 1.0:  # the expert's gradient scaled, the rows' kept
                given = ScaleGrad.apply(given, 1.0 / self.grad_scale)
            answer = expert(given)
            if self.grad_scale != 1.0:
                answer = ScaleGrad.apply(answer, self.grad_scale)
            output = output.index_add(0, chosen, answer.to(output.dtype))
        return output


class _Slot:
    """One expert of a `ListedExperts`, as the block sees it."""

    def __init__(self, owner: ListedExperts, index: int) -> None:
        self.owner, self.index = owner, index

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.owner.called(self.index, args, kwargs)


class TwoPassBlock(nn.Module):
    """A block whose experts are a `ListedExperts` (its class made a subclass of this one and of its own, as FSDP2
    does): its own forward, run twice (see above)."""

    expert_list_child: str

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        experts = self._modules[self.expert_list_child]
        assert isinstance(experts, ListedExperts)
        with experts.routing():
            super().forward(*args, **kwargs)
        with experts.answering():
            return super().forward(*args, **kwargs)


def apply_ep_to_lists(model: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Replace every expert list of ``model`` by this rank's `ListedExperts` over the 1-D ep ``mesh``, its block made
    a `TwoPassBlock`; returns the lists' names."""
    found = expert_lists(model)
    for experts in found:
        block = model.get_submodule(experts.block)
        child = experts.name.rpartition(".")[2]
        setattr(block, child, ListedExperts(cast(nn.ModuleList, block._modules[child]), mesh, experts.hidden, experts.name))
        setattr(block, "expert_list_child", child)
        block.__class__ = _two_pass_class(type(block))
    return [experts.name for experts in found]


_TWO_PASS_CLASSES: dict[type, type] = {}


def _two_pass_class(block: type) -> type:
    """One `TwoPassBlock` subclass of each block class, made on first use."""
    if block not in _TWO_PASS_CLASSES:
        _TWO_PASS_CLASSES[block] = type(f"TwoPass{block.__name__}", (TwoPassBlock, block), {"__module__": __name__})
    return _TWO_PASS_CLASSES[block]


def entries_held_here(model: nn.Module, entries: Mapping[str, T]) -> dict[str, T]:
    """A tp plan's ``entries`` without the modules of the listed experts other ep ranks hold."""
    elsewhere = tuple(f"{name}.{index}" for name, module in model.named_modules() if isinstance(module, ListedExperts)
                      for index in module.elsewhere())
    return {name: style for name, style in entries.items()
            if not any(name == other or name.startswith(other + ".") for other in elsewhere)}


def mark_expert_shares(model: nn.Module) -> None:
    """Mark the parameters of listed experts for gradient clipping: each ep rank holds other experts. After FSDP and
    materialising (both may replace the parameters)."""
    for module in model.modules():
        if isinstance(module, ListedExperts):
            for param in module.parameters():
                setattr(param, HELD_BY_ONE_EP_RANK_OF, module.size)
