"""Checkpoints that survive layout changes and failures (sharded DCP folders, one-file exports).

`NDParallel` saves and loads through these when Lightning asks (``ModelCheckpoint``,
``Trainer(ckpt_path=...)``); ``python -m lightning_nd.checkpoint`` inspects, verifies and exports.
"""

from lightning_nd.checkpoint.export import export, read_sharded
from lightning_nd.checkpoint.files import CheckpointError, CheckpointMismatch, is_complete
from lightning_nd.checkpoint.full import load_full
from lightning_nd.checkpoint.listing import complete_checkpoints, latest_checkpoint, resume_path
from lightning_nd.checkpoint.sharded import load_sharded, save_sharded

__all__ = ["CheckpointError", "CheckpointMismatch", "complete_checkpoints", "export", "is_complete", "latest_checkpoint",
           "load_full", "load_sharded", "read_sharded", "resume_path", "save_sharded"]
