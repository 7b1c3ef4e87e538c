"""Mixture-of-experts auxiliary losses under pp: each stage adds its own layers' losses to its backward.

One process adds every layer's auxiliary loss to the training loss (``loss = ce + moe_aux_loss(model)``).
Under pp the layers live on several stages and a stage hands on one tensor, so each stage adds its layers'
losses itself: on the last stage to the microbatch's loss, on the others through `attach`, an identity on
the stage's output whose backward also gives each auxiliary loss the gradient the microbatch loss gets (its
scale, 1 / (microbatches x accumulation)), as Megatron-Core's MoE layers do (``MoEAuxLossAutoScaler``).
Inside a pipelined step `lightning_nd.nn.moe.moe_aux_loss` returns 0.0, so the step's own sum does not
count them twice.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_nd.nn.moe import moe_layers


class StageAuxLosses:
    """The MoE layers of one stage and the auxiliary losses of their latest forward."""

    def __init__(self, module: nn.Module) -> None:
        self.layers = moe_layers(module)
        self.scale = 0.0
        """The gradient each auxiliary loss gets in backward; 0 outside a pipelined training step (nothing added)."""

    @property
    def weighted(self) -> bool:
        """Whether the losses count at all (a coefficient is not zero)."""
        return any(layer.aux_loss_coef or layer.z_loss_coef for layer in self.layers)

    def reset(self) -> None:
        for layer in self.layers:
            layer.aux_loss = None

    def collect(self) -> torch.Tensor | None:
        losses = [layer.aux_loss for layer in self.layers if layer.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None


class _Attach(torch.autograd.Function):
    """Identity on ``output``; in backward the auxiliary loss gets gradient ``scale``. The value handed on is a
    copy, not a view: FSDP2 warns of every view a wrapped stage returns (an in-place op on one would skip its
    pre-backward hook), and the stage's own output tensor is freed once copied, so only the copy is kept."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.like = scale, aux.detach()
        return output.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full_like(ctx.like, ctx.scale), None


def attach(output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    return _Attach.apply(output, aux, scale)
