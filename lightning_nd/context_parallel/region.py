"""The context-parallel region: while a step runs, attention and positions see the whole sequence.

Inside `context_parallel_region(group, positions)` every ``F.scaled_dot_product_attention`` call on this
rank's sequence shard (query length == the shard's) runs as exact ring attention over the cp group,
with causal masking by the true global ``positions``; models and Hugging Face code call SDPA through the
``torch.nn.functional`` module, so no model is edited. `inject_positions` (a forward pre-hook the
composer puts on the model) passes the global positions as ``position_ids`` to a model whose forward
takes them (rotary and learned position embeddings), and an all-ones ``attention_mask`` to one that
takes that too, so Hugging Face does not read the zigzag positions as packed sequences; `check_shard_output`
(a forward hook) refuses a model whose output has no per-token dim, as pooling over the shard would.
`nn.MultiheadAttention` calls SDPA too, except on its inference fast path, which the region turns off.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.distributed_c10d import ProcessGroup
from torch.distributed.fsdp import FSDPModule

from lightning_nd.context_parallel.positions import forward_signature
from lightning_nd.context_parallel.ring_attention import ring_attention
from lightning_nd.model.batch import tensors_of


@dataclass(eq=False)
class _Region:
    group: ProcessGroup
    positions: torch.Tensor
    report: Callable[[str, dict], None] | None = None
    routed: int = 0
    every_position: torch.Tensor | None = None
    """Every cp rank's positions, when the caller knows them (`sharding.every_shard_positions`): the ring then needs
    no all-gather to learn them."""


class _Regions(threading.local):
    """Each thread's open regions (`lightning_nd.check` runs ranks as threads of one process)."""

    def __init__(self) -> None:
        self.open: list[_Region] = []
        self.own_only = False


_threads = _Regions()
_everywhere: list[_Region] = []  # every thread's, in opening order, for a thread that opened none (see `_current`)
_outside: list = []  # F.scaled_dot_product_attention and the MHA fast path's switch before the outermost region
_depth = [0]  # regions open in all threads: the switch is made by the first and undone by the last


@contextmanager
def context_parallel_region(group: ProcessGroup, positions: torch.Tensor, *, expect_attention: bool = False,
                            report: Callable[[str, dict], None] | None = None,
                            every_position: torch.Tensor | None = None) -> Iterator[None]:
    """Route SDPA to ring attention and expose ``positions`` (this rank's global token positions).

    With ``expect_attention`` (a forward step), a region in which no attention was routed raises: the
    model attended only within this rank's shard (eager/flash attention, or SDPA imported by name).
    """
    region = _Region(group, positions, report, every_position=every_position)
    if not _depth[0]:
        _outside.append((F.scaled_dot_product_attention, torch.backends.mha.get_fastpath_enabled()))
        F.scaled_dot_product_attention = _routed_sdpa
        # `nn.MultiheadAttention`'s inference fast path is a fused kernel that never calls SDPA.
        torch.backends.mha.set_fastpath_enabled(False)
    _depth[0] += 1
    _threads.open.append(region)
    _everywhere.append(region)
    try:
        yield
    finally:
        _threads.open.pop()
        del _everywhere[next(i for i, open_ in enumerate(_everywhere) if open_ is region)]
        _depth[0] -= 1
        if not _depth[0]:
            F.scaled_dot_product_attention, fastpath = _outside.pop()
            torch.backends.mha.set_fastpath_enabled(fastpath)
    if expect_attention and region.routed == 0:
        raise ValueError(
            "Context parallelism: the step ran no `torch.nn.functional.scaled_dot_product_attention` call over this"
            " rank's shard of the sequence, so attention saw only the shard. HINT: use SDPA attention (Hugging Face:"
            " `attn_implementation=\"sdpa\"`; your own code: call it as"
            " `torch.nn.functional.scaled_dot_product_attention` or `F.scaled_dot_product_attention`), or use cp=1."
        )


def regions_of_this_thread_only() -> None:
    """From now on this thread sees only the regions it opens itself (each rank thread of `lightning_nd.check`)."""
    _threads.own_only = True


def _current() -> _Region | None:
    """This thread's innermost region; in a thread that opened none, while it runs a backward, the last one any
    thread opened: on CUDA, autograd's device thread runs backward, and with it the recomputation of a
    checkpointed block, inside the step's region that the training thread opened. Other threads (a user's
    evaluation thread, each rank thread of `lightning_nd.check`) see none."""
    if _threads.open:
        return _threads.open[-1]
    if _threads.own_only or torch._C._current_graph_task_id() == -1:  # only a thread running a backward borrows
        return None
    everywhere = list(_everywhere)  # another thread may close its region meanwhile
    return everywhere[-1] if everywhere else None


def current_positions() -> torch.Tensor | None:
    """The global positions of this rank's tokens inside the region, else None."""
    region = _current()
    return region.positions if region is not None else None


def _routed_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                 **kwargs):
    region = _current()
    if region is None or query.shape[-2] != region.positions.numel():  # not attention over this shard
        return _outside[-1][0](query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                               scale=scale, enable_gqa=enable_gqa, **kwargs)
    if attn_mask is not None:
        raise ValueError(
            "Context parallelism got an explicit attention mask: ring attention supports causal and full attention"
            " over the whole sequence, not padding, packed-sequence or custom masks. HINT: train on unpadded"
            " sequences of one length (pack without masks), or use cp=1."
        )
    if dropout_p:
        raise ValueError(f"Context parallelism does not support attention dropout (dropout_p={dropout_p}). HINT: set"
                         " the model's attention dropout to 0 (e.g. `attention_dropout=0.0`), or use cp=1.")
    region.routed += 1
    return ring_attention(query, key, value, region.positions, region.group, causal=is_causal, scale=scale,
                          report=region.report, every_position=region.every_position)


def inject_positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook: inside the region, give the model the global positions (see the module docstring)."""
    positions = current_positions()
    if positions is None:
        return None
    signature = forward_signature(type(module).forward)
    given = signature.bind_partial(None, *args, **kwargs).arguments
    tokens = _shard_tokens(args, kwargs, positions)
    if tokens is None:  # not a call on this rank's shard
        return None
    if given.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError(
            f"`{_class_name(module)}` was given `labels` under context parallelism: a model that shifts labels"
            " inside its own loss would pair tokens across the shard's head and tail chunks. HINT: put next-token"
            " targets, shifted before the batch is split, in the batch and compute the loss outside the model"
            " (as examples/lit.py does), or give a Hugging Face model those targets as `shift_labels=` as well"
            " (a batch entry, so the strategy splits it with the tokens; it then does not shift `labels`)."
        )
    extra = {}
    if "position_ids" in signature.parameters and given.get("position_ids") is None:
        extra["position_ids"] = positions.to(tokens.device)[None].expand(tokens.shape[0], -1)
    if "attention_mask" in signature.parameters and given.get("attention_mask") is None:
        extra["attention_mask"] = torch.ones(tokens.shape[0], positions.numel(), dtype=torch.long, device=tokens.device)
    return (args, {**kwargs, **extra}) if extra else None


def check_shard_output(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
    """Forward hook: inside the region, a call on this rank's shard must return per-token outputs (a dim of the
    shard's length in front). A model that pools over the sequence (mean, first token) would pool its shard."""
    positions = current_positions()
    if positions is None or _shard_tokens(args, kwargs, positions) is None:
        return
    result = next((t for t in tensors_of(output) if t.ndim >= 1), None)
    if result is not None and positions.numel() not in result.shape[:2]:
        raise ValueError(
            f"`{_class_name(module)}` returned a {tuple(result.shape)} output for this rank's {positions.numel()}"
            " tokens under context parallelism: it reduces over the sequence (pooling, a first-token classifier),"
            " so each rank would reduce only its shard. HINT: use cp=1 for models that pool over the sequence, or"
            " return per-token outputs and reduce over the cp group in `training_step`."
        )


def _class_name(module: nn.Module) -> str:
    """The model's own class name, not the one FSDP wraps it in."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__


def _shard_tokens(args: tuple, kwargs: dict, positions: torch.Tensor) -> torch.Tensor | None:
    """The first [batch, seq, ...] input, if this is a call on this rank's shard (its dim 1 is the shard's length)."""
    tokens = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.ndim >= 2), None)
    return tokens if tokens is not None and tokens.shape[1] == positions.numel() else None


def attach_position_hooks(module: nn.Module, cp_positions: str) -> None:
    """The hooks of the region on the model the step calls, unless the model handles positions itself."""
    if cp_positions == "position_ids":
        module.register_forward_pre_hook(inject_positions, with_kwargs=True)
        module.register_forward_hook(check_shard_output, with_kwargs=True)
