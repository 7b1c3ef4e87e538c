"""Kineto, torch's profiler backend, writes a line to the process's stderr at every profiler start and stop
(``USDT:... profiler_start``, ``profiler_stop``): one pair per profiled step of every rank on the console. Around
the monitor's own start and stop those lines are dropped; anything else written to stderr meanwhile is passed on.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

NOTE_PREFIX = b"USDT:"


@contextmanager
def without_profiler_notes() -> Iterator[None]:
    """stderr (file descriptor 2, where the C++ library writes) without Kineto's start/stop notes."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True) if not line.startswith(NOTE_PREFIX)]
            if kept:
                os.write(2, b"".join(kept))
