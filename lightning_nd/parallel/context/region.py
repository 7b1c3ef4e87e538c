"""The context-parallel region: while a step runs, attention and positions see the whole sequence.

Inside `context_parallel_region(group, positions)` every ``F.scaled_dot_product_attention`` call on this
rank's sequence shard (query length == the shard's) runs as exact ring attention over the cp group,
with causal masking by the true global ``positions``; models and Hugging Face code call SDPA through the
``torch.nn.functional`` module, so no model is edited. `inject_positions` (a forward pre-hook the
composer puts on the model) passes the global positions as ``position_ids`` to a model whose forward
takes them (rotary and learned position embeddings), and an all-ones ``attention_mask`` to one that
takes that too, so Hugging Face does not read the zigzag positions as packed sequences.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.distributed_c10d import ProcessGroup

from lightning_nd.nn.ring_attention import ring_attention

@dataclass
class _Region:
    group: ProcessGroup
    positions: torch.Tensor
    report: Callable[[str, dict], None] | None = None
    routed: int = 0


_active: list[_Region] = []
_outside: list = []  # what F.scaled_dot_product_attention was before the outermost region


@contextmanager
def context_parallel_region(group: ProcessGroup, positions: torch.Tensor, *, expect_attention: bool = False,
                            report: Callable[[str, dict], None] | None = None) -> Iterator[None]:
    """Route SDPA to ring attention and expose ``positions`` (this rank's global token positions).

    With ``expect_attention`` (a forward step), a region in which no attention was routed raises: the
    model attended only within this rank's shard (eager/flash attention, or SDPA imported by name).
    """
    region = _Region(group, positions, report)
    if not _active:
        _outside.append(F.scaled_dot_product_attention)
        F.scaled_dot_product_attention = _routed_sdpa
    _active.append(region)
    try:
        yield
    finally:
        _active.pop()
        if not _active:
            F.scaled_dot_product_attention = _outside.pop()
    if expect_attention and region.routed == 0:
        raise ValueError(
            "Context parallelism: the step ran no `torch.nn.functional.scaled_dot_product_attention` call over this"
            " rank's shard of the sequence, so attention saw only the shard. HINT: use SDPA attention (Hugging Face:"
            " `attn_implementation=\"sdpa\"`; your own code: call it as `torch.nn.functional.scaled_dot_product_attention`"
            " or `F.scaled_dot_product_attention`), or use cp=1."
        )


def current_positions() -> torch.Tensor | None:
    """The global positions of this rank's tokens inside the region, else None."""
    return _active[-1].positions if _active else None


def _routed_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                 **kwargs):
    region = _active[-1] if _active else None
    if region is None or query.shape[-2] != region.positions.numel():  # not attention over this shard
        return _outside[-1](query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa, **kwargs)
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
    return ring_attention(query, key, value, region.positions.to(query.device), region.group, causal=is_causal,
                          scale=scale, report=region.report)


def inject_positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook: inside the region, give the model the global positions (see the module docstring)."""
    positions = current_positions()
    if positions is None:
        return None
    signature = _signature(type(module).forward)
    given = signature.bind_partial(None, *args, **kwargs).arguments
    tokens = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.ndim >= 2), None)
    if tokens is None or tokens.shape[1] != positions.numel():  # not a call on this rank's shard
        return None
    if given.get("labels") is not None:
        raise ValueError(
            f"`{type(module).__name__}` was given `labels` under context parallelism: a model that shifts labels"
            " inside its own loss would pair tokens across the shard's head and tail chunks. HINT: put next-token"
            " targets, shifted before the batch is split, in the batch and compute the loss outside the model"
            " (as examples/lit.py does), or pass them as `shift_labels` to a Hugging Face model."
        )
    extra = {}
    if "position_ids" in signature.parameters and given.get("position_ids") is None:
        extra["position_ids"] = positions.to(tokens.device)[None].expand(tokens.shape[0], -1)
    if "attention_mask" in signature.parameters and given.get("attention_mask") is None:
        extra["attention_mask"] = torch.ones(tokens.shape[0], positions.numel(), dtype=torch.long, device=tokens.device)
    return (args, {**kwargs, **extra}) if extra else None


@functools.cache
def _signature(forward) -> inspect.Signature:
    return inspect.signature(forward)


def accepts_positions(module: nn.Module) -> bool:
    return "position_ids" in _signature(type(module).forward).parameters
