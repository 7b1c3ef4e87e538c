"""Diagnostics for N-D parallel runs: pure analyses (``analysis/``) and thin Lightning callbacks
(``callbacks/``) that log what they find to TensorBoard as tables a person can act on."""

from diagnostics.callbacks.layout import LayoutCard

__all__ = ["LayoutCard"]
