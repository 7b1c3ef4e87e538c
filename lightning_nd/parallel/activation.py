"""Activation checkpointing and compilation per block: ``apply_ac(blocks, mode)``, ``apply_compile(blocks)``.

Both act on the block in place (its ``forward`` / its call), so parameter names and checkpoint
keys do not change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

ACMode = Literal["none", "full", "selective"]

# Outputs worth keeping under selective AC: the matmuls and attention, which are costly to redo
# and small next to the elementwise intermediates (norms, activations, softmax inputs) we recompute.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward: Callable, selective: bool) -> Callable:
    context_fn = partial(create_selective_checkpoint_contexts, _selective_policy) if selective else None

    def run(*args, **kwargs):
        extra = {"context_fn": context_fn} if context_fn else {}
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    return run


def apply_ac(blocks: Sequence[nn.Module], mode: ACMode) -> None:
    """``full`` recomputes each block in backward; ``selective`` keeps matmul/attention outputs."""
    if mode == "none":
        return
    for block in blocks:
        block.forward = _checkpointed(block.forward, selective=mode == "selective")


def apply_compile(blocks: Sequence[nn.Module], backend: str = "inductor") -> None:
    """``torch.compile`` each block separately: repeated blocks share one compiled graph."""
    for block in blocks:
        block.compile(backend=backend, fullgraph=False)
