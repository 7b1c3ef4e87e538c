"""Torch-level machinery the strategy runs on: the device mesh, materialising meta models, clipping, timeouts,
the dead-rank watchdog and the profiler labels. No Lightning here."""
