"""Torch-level machinery the strategy runs on: materialising meta models, clipping, timeouts, the dead-rank
watchdog and the profiler labels. No Lightning here."""
