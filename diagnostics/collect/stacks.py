"""Every thread's Python stack, innermost first: where a rank is when it is not in a collective."""

from __future__ import annotations

import sys
import threading
import traceback

from diagnostics.records import Frame


def thread_stacks() -> tuple[dict[str, tuple[Frame, ...]], str]:
    """Stacks by thread name (the id appended when two threads share a name), and the main thread's name."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    stacks: dict[str, tuple[Frame, ...]] = {}
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, f"thread-{ident}")
        if name in stacks:
            name = f"{name}-{ident}"
        summary = traceback.extract_stack(frame)
        stacks[name] = tuple(Frame(f.filename, f.lineno or 0, f.name) for f in reversed(summary))
    return stacks, threading.main_thread().name


def stacks_text(stacks: dict[str, tuple[Frame, ...]]) -> str:
    """The stacks as a person reads a traceback: outermost first."""
    blocks = []
    for name, frames in stacks.items():
        lines = [f"Thread {name!r} (most recent call last):"]
        lines += [f'  File "{f.file}", line {f.line}, in {f.name}' for f in reversed(frames)]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"
