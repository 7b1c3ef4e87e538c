"""Dropout under tensor parallelism: one mask where activations are replicated, a different one per rank where
they are split by heads or features.

Every rank is seeded alike, so a replicated activation gets the same mask on every tp rank by itself (as it
must: the ranks' copies stay equal). Inside an attention or MLP module whose activations are split, the same
stream would give rank 0's heads the very masks of rank 1's heads. There each rank draws from its own stream,
seeded from the shared one, which it leaves where every rank leaves it. DTensor's own RNG tracker covers only
random ops on DTensors on CUDA (``torch.distributed.tensor._random.is_rng_supported_mesh``); these activations
are local tensors. Activation checkpointing restores the shared stream before recomputing, so the recomputed
masks are the same.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

SEED_RANGE = 2**62


def has_dropout(module: nn.Module) -> bool:
    """Whether ``module`` can drop anything: an ``nn.Dropout`` with p > 0, or a float ``*dropout*`` attribute
    above 0 (Hugging Face attention passes ``self.attention_dropout`` to its attention function)."""
    for sub in module.modules():
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
            return True
        if any("dropout" in attr and isinstance(value, float) and value > 0 for attr, value in vars(sub).items()):
            return True
    return False


def fork_rng_per_rank(module: nn.Module, tp_rank: int) -> None:
    """In training, ``module`` runs on its own random stream for this tp rank."""
    forks: list[contextlib.ExitStack] = []

    def enter(mod: nn.Module, args: tuple) -> None:
        if not mod.training:
            return
        seed = int(torch.randint(SEED_RANGE, ())) * 8191 + tp_rank  # advances the shared stream alike on every rank
        stack = contextlib.ExitStack()
        devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
        stack.enter_context(torch.random.fork_rng(devices=devices))
        torch.manual_seed(seed % SEED_RANGE)
        forks.append(stack)

    def leave(mod: nn.Module, args: tuple, output: object) -> None:
        if mod.training and forks:
            forks.pop().close()

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)
