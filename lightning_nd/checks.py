"""Checks the strategy makes about the user's module and batches, outside the composer's own.

Kept apart from `strategy.py` so the glue stays glue; these need Lightning's notion of a module.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_nd.materialize import check_initialisable
from lightning_nd.parallel.context import sequence_length, shard_positions, shard_sequence

log = logging.getLogger("lightning_nd")


def check_sequence_lengths(batch: Any, tp: int) -> None:
    """Sequence parallel splits dim 1 of every activation over tp: token tensors must divide by it."""
    def check(tensor: Tensor) -> None:
        if tensor.ndim >= 2 and not tensor.is_floating_point() and tensor.shape[1] % tp:
            raise ValueError(
                f"`NDParallel(sequence_parallel=True, tp={tp})` splits the sequence over tp, but the batch has a"
                f" tensor of shape {tuple(tensor.shape)} whose sequence length {tensor.shape[1]} does not divide by"
                f" {tp}. HINT: pad or crop sequences to a multiple of {tp}, or set sequence_parallel=False."
            )

    apply_to_collection(batch, Tensor, check)


def shard_batch(batch: Any, cp: int, rank: int, keys: Sequence[str] | None) -> tuple[Any, Tensor]:
    """This cp rank's zigzag shard of every sequence tensor of the batch, and the global positions it holds."""
    seq_len = sequence_length(batch)
    if seq_len is None:
        raise ValueError("Context parallelism splits the sequence, and the batch has no integer [batch, seq] tensor"
                         " (token ids) to read its length from. HINT: put token ids in the batch, or use cp=1.")
    if seq_len % (2 * cp):
        raise ValueError(
            f"`NDParallel(cp={cp})` splits each sequence into {2 * cp} chunks (two per rank, head and tail, so causal"
            f" attention work is balanced), but the batch's sequence length is {seq_len}. HINT: pad or crop sequences"
            f" to a multiple of {2 * cp}."
        )
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if isinstance(mask, Tensor) and not bool(mask.all()):
        raise ValueError(
            "Context parallelism got a batch whose `attention_mask` masks tokens (padding): ring attention covers"
            " causal and full attention over whole sequences only. HINT: pack sequences to one length without"
            " padding, or use cp=1."
        )
    positions = shard_positions(seq_len, cp, rank, "zigzag")
    return shard_sequence(batch, positions, seq_len, keys), positions


def model_to_check(model: LightningModule) -> torch.nn.Module | None:
    """The module whose structure `check_model` validates before any process group exists.

    A model built in `configure_model` does not exist yet: build it on a meta-device copy. If that
    hook needs the running job (it reads `self.device_mesh`), None: the composer checks in `setup`.
    """
    if any(True for _ in model.parameters()) or not is_overridden("configure_model", model):
        return model
    try:
        # The attached Trainer (loggers, dataloaders, the strategy) is shared, not copied.
        probe = copy.deepcopy(model, memo={id(model._trainer): model._trainer} if model._trainer else None)
        with torch.device("meta"):
            probe.configure_model()
    except Exception as error:  # the hook needs the process group; `setup` checks the real model
        log.debug("configure_model could not run before the processes start (%s); checking in setup", error)
        return None
    if not any(True for _ in probe.parameters()):
        return None
    check_initialisable(probe)
    return probe


def already_parallel(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )
