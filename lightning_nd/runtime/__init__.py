"""Torch-level machinery the strategy runs on: the device mesh, materialising meta models, clipping, timeouts
and the dead-rank watchdog. No Lightning here."""
