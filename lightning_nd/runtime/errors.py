"""An exception and what it wraps, read as one: torch's pipeline schedule re-raises a stage's error as "[Stage 0]
failed to run forward" with the original only in ``__cause__``, so every classification of a failure (out of
memory, a peer's lost connection, the verdict's one line) reads the whole chain, in this one place."""

from __future__ import annotations

import torch

OUT_OF_MEMORY_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory")
"""What an out-of-memory error says (CUDA's and ROCm's allocators, the CPU allocator on Linux and on Windows), in
lower case: how the strategy tells one from other failures, and a listener a peer's relayed failure."""


def exception_chain(exception: BaseException) -> list[BaseException]:
    """``exception``, then what it was raised from (``__cause__``) or during (``__context__``), each once."""
    chain: list[BaseException] = []
    link: BaseException | None = exception
    while link is not None and all(link is not seen for seen in chain):
        chain.append(link)
        link = link.__cause__ or link.__context__
    return chain


def says_out_of_memory(text: str) -> bool:
    lowered = text.lower()
    return any(words in lowered for words in OUT_OF_MEMORY_WORDS)


def out_of_memory_in(exception: BaseException) -> BaseException | None:
    """The link of the chain that is an out-of-memory error (the outermost such), or None."""
    return next((link for link in exception_chain(exception)
                 if isinstance(link, torch.OutOfMemoryError) or says_out_of_memory(str(link))), None)


def first_line(exception: BaseException) -> str:
    """``Type: its first non-blank line`` (the type alone when it says nothing)."""
    line = next((line.strip() for line in str(exception).splitlines() if line.strip()), "")
    return f"{type(exception).__name__}: {line}" if line else type(exception).__name__


def chain_text(exception: BaseException) -> str:
    """Every link as ``Type: message``, outermost first: what a search for a word must read."""
    return "\n".join(f"{type(link).__name__}: {link}" for link in exception_chain(exception))
