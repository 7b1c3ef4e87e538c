"""Diagnostics for N-D parallel runs: thin Lightning callbacks (``callbacks/``) that log what they find to
TensorBoard as tables a person can act on; the analyses they call are pure functions (``analysis/``, filled
by the monitors to come; the layout card renders `lightning_nd.layout.describe`)."""

from diagnostics.callbacks.layout import LayoutCard

__all__ = ["LayoutCard"]
