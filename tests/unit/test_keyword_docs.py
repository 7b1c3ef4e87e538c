"""`NDParallel`'s keywords are documented where an IDE shows them: its docstring's ``Arguments:`` block is the one
generated from the keyword table (`lightning_nd/layout/arguments.py`: the dims', the options' from `ParallelConfig`'s
field docstrings, the runtime settings'), entry for entry, and the table names every keyword of the constructor."""

from __future__ import annotations

import inspect

from lightning_nd.layout.arguments import KEYWORDS, arguments_block, keyword_meanings
from lightning_nd.strategy.nd_parallel import NDParallel


def test_the_docstring_holds_the_generated_arguments_block():
    block = arguments_block()
    assert NDParallel.__doc__ is not None and block in NDParallel.__doc__, (
        "NDParallel's docstring drifted from the keyword table; paste this block into it:\n" + block)


def test_the_table_documents_every_keyword_of_the_constructor():
    parameters = [name for name in inspect.signature(NDParallel.__init__).parameters if name != "self"]
    meanings = keyword_meanings()
    assert list(meanings) == list(KEYWORDS) and sorted(KEYWORDS) == sorted(parameters)
    assert all(len(meaning) > 20 for meaning in meanings.values()), meanings
    for key in KEYWORDS:
        assert f"        {key}: " in arguments_block(), key
