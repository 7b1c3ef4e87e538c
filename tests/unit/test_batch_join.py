"""What the microbatches give, joined into what the whole batch gives (`pipeline_parallel/batch_join.py`): the inverse of
`own_steps.microbatch`, on model outputs (tensors, tuples, dicts, Hugging Face outputs) and metric arguments."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from lightning_nd.pipeline_parallel.batch_join import NotJoinable, join_microbatches, map_tensors
from lightning_nd.pipeline_parallel.own_steps import microbatch


def test_splitting_then_joining_gives_the_batch_back():
    Pair = namedtuple("Pair", "ids weights")
    batch = {"x": torch.randn(5, 3), "pair": Pair(torch.arange(5), torch.ones(5, 2)), "names": list("abcde"),
             "scale": 2.0, "mask": None}
    parts = [microbatch(batch, i, 3, 5) for i in range(3)]
    parts = [{**part, "names": batch["names"][start:end]} for part, (start, end) in zip(parts, [(0, 2), (2, 4), (4, 5)])]
    joined = join_microbatches(parts)
    assert torch.equal(joined["x"], batch["x"]) and torch.equal(joined["pair"].weights, batch["pair"].weights)
    assert isinstance(joined["pair"], Pair) and joined["names"] == batch["names"]
    assert joined["scale"] == 2.0 and joined["mask"] is None


def test_a_flattened_tensor_joins_as_the_flattened_batch():
    logits = torch.randn(4, 3, 7)
    parts = [part.flatten(0, 1) for part in logits.chunk(2)]
    assert torch.equal(join_microbatches(parts), logits.flatten(0, 1))


def test_a_hugging_face_output_keeps_its_type_and_fields():
    logits = torch.randn(4, 5, 11)
    parts = [CausalLMOutputWithPast(logits=part) for part in logits.chunk(2)]
    joined = join_microbatches(parts, "the model's output")
    assert isinstance(joined, CausalLMOutputWithPast) and torch.equal(joined.logits, logits) and joined.loss is None
    whole = map_tensors(joined, lambda tensor: tensor * 2)
    assert isinstance(whole, CausalLMOutputWithPast) and torch.equal(whole.logits, 2 * logits)


def test_a_value_that_differs_between_microbatches_without_a_batch_dim_is_named():
    with pytest.raises(NotJoinable, match=r"the model's output\['loss'\]: a Tensor that differs .*\(1.5, 2.5\)"):
        join_microbatches([{"loss": torch.tensor(1.5)}, {"loss": torch.tensor(2.5)}], "the model's output")
    with pytest.raises(NotJoinable, match=r"shapes differ past dim 0"):
        join_microbatches([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(NotJoinable, match="other keys"):
        join_microbatches([{"a": 1}, {"b": 1}])
    assert join_microbatches([torch.tensor(3.0), torch.tensor(3.0)]).item() == 3.0  # the same everywhere: kept


def test_map_tensors_reaches_every_tensor_and_keeps_the_structure():
    Pair = namedtuple("Pair", "a b")
    value = {"t": torch.ones(2), "nested": [Pair(torch.zeros(1), "tag")], "n": 3}
    doubled = map_tensors(value, lambda tensor: tensor + 1)
    assert doubled["t"].tolist() == [2.0, 2.0] and doubled["nested"][0].a.tolist() == [1.0]
    assert doubled["nested"][0].b == "tag" and doubled["n"] == 3 and isinstance(doubled["nested"][0], Pair)
