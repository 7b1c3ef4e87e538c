"""How a failed run ended, in the four words a sweep's table uses: refused, out of memory, hang, crash.

Read from the error alone (the names of its classes and of the errors it was raised from, its message) and whether
an optimizer step had completed, so it runs where the error was caught and again on a record read back later.
"""

from __future__ import annotations

import re

OOM_CLASSES = ("OutOfMemoryError", "MemoryError")
OOM_WORDS = re.compile(r"(?<!or )out of memory|CUBLAS_STATUS_ALLOC_FAILED|can(not|'t) allocate memory|not enough"
                       r" memory", re.IGNORECASE)
HANG_WORDS = re.compile(r"timed out|timeout after|watchdog caught collective operation timeout", re.IGNORECASE)
NCCL_TIMEOUT = re.compile(r"watchdog caught collective operation timeout", re.IGNORECASE)
PEER_WORDS = re.compile(r"connection (closed|reset) by peer|broken pipe|\bdied\b", re.IGNORECASE)
REFUSAL_CLASSES = ("ValueError", "TypeError", "NotImplementedError")
REASON_CHARS = 300


def classify(class_names: tuple[str, ...], message: str, stepped: bool) -> str:
    """``class_names``: the error's classes with their bases, then those of its causes; ``stepped``: whether an
    optimizer step had completed. A refusal is the library's own (its message gives a HINT) and comes before
    training; a lost peer is a crash, not a hang (the peer's own failure is the cause)."""
    if any(name in OOM_CLASSES for name in class_names) or OOM_WORDS.search(message):
        return "oom"
    if PEER_WORDS.search(message) and not re.search(r"timed out", message, re.IGNORECASE) and not (
            NCCL_TIMEOUT.search(message)):
        return "crash"
    if HANG_WORDS.search(message) or any("Timeout" in name for name in class_names):
        return "hang"
    if not stepped and "HINT" in message and any(name in REFUSAL_CLASSES for name in class_names):
        return "refused"
    return "crash"


def reason(class_name: str, message: str) -> str:
    """The error's type, its first line and its HINT (the fix) where it gave one, at most `REASON_CHARS` long."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    first = _sentence(lines[0].split("HINT")[0]) if lines else "(no message)"
    hint = next((_sentence(line[line.index("HINT"):]) for line in lines if "HINT" in line), "")
    text = f"{class_name}: {first}" + (f" {hint}" if hint else "")
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 3] + "..."


def _sentence(text: str) -> str:
    """Up to the end of the first sentence (a period followed by a space, outside backticks)."""
    ticks = 0
    for index, char in enumerate(text):
        ticks += char == "`"
        if char == "." and ticks % 2 == 0 and text[index + 1:index + 2] in (" ", ""):
            return text[:index + 1].strip()
    return text.strip()
