"""Batch sharding for context parallelism and the SDPA routing rules, on one process."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from lightning_nd.context_parallel.region import (
    attach_position_hooks,
    context_parallel_region,
    current_positions,
    inject_positions,
    regions_of_this_thread_only,
)
from lightning_nd.context_parallel.sharding import shard_batch, shard_positions, shard_sequence
from lightning_nd.model.batch import sequence_length
from tests.models import build


def test_every_sequence_tensor_gets_the_same_permutation():
    tokens = torch.arange(16).view(2, 8)
    batch = {"tokens": tokens, "labels": tokens + 100, "mask": torch.ones(2, 8, 3), "ids": torch.tensor([7, 9])}
    assert sequence_length(batch) == 8
    shard, positions = shard_batch(batch, 2, 1, None)
    assert positions.tolist() == [2, 3, 4, 5]
    assert shard["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert torch.equal(shard["labels"], shard["tokens"] + 100)
    assert shard["mask"].shape == (2, 4, 3) and torch.equal(shard["ids"], batch["ids"])
    only = shard_sequence(batch, positions, 8, keys=["tokens"])
    assert only["labels"].shape == (2, 8)


def test_a_sequence_that_does_not_split_into_2cp_chunks_names_the_fix():
    with pytest.raises(ValueError, match=r"cp=4.*8 chunks.*length is 12.*HINT.*multiple of 8"):
        shard_batch({"tokens": torch.zeros(2, 12, dtype=torch.long)}, 4, 0, None)
    with pytest.raises(ValueError, match="no integer.*HINT"):
        shard_batch({"x": torch.zeros(2, 8)}, 2, 0, None)


def test_sdpa_is_routed_only_inside_the_region_and_refuses_masks():
    q = k = v = torch.randn(1, 2, 4, 8)
    other = torch.randn(1, 2, 3, 8)  # not this shard's length: plain attention even inside the region
    plain, plain_other = F.scaled_dot_product_attention(q, k, v, is_causal=True), F.scaled_dot_product_attention(other, other, other)
    with context_parallel_region(None, shard_positions(8, 2, 0)):
        assert current_positions().tolist() == [0, 1, 6, 7]
        with pytest.raises(ValueError, match="attention mask.*HINT"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool))
        with pytest.raises(ValueError, match="dropout.*HINT"):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        torch.testing.assert_close(F.scaled_dot_product_attention(other, other, other), plain_other)
    assert current_positions() is None
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True), plain)


def test_models_taking_position_ids_get_the_global_positions():
    model = build("hf_llama")
    seen = {}
    model.register_forward_pre_hook(inject_positions, with_kwargs=True)
    model.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    tokens = torch.zeros(2, 4, dtype=torch.long)
    with context_parallel_region(None, torch.tensor([2, 3, 4, 5])):
        with pytest.raises((RuntimeError, ValueError), match="process group"):
            model(tokens)  # attention needs a cp group; the hooks have run by then
    assert seen["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    assert seen["attention_mask"].tolist() == [[1, 1, 1, 1]] * 2


def test_regions_nest_and_always_restore_sdpa():
    original = F.scaled_dot_product_attention
    with pytest.raises(KeyError):
        with context_parallel_region(None, torch.arange(4)):
            with context_parallel_region(None, torch.arange(2)):
                assert current_positions().tolist() == [0, 1]
            assert current_positions().tolist() == [0, 1, 2, 3]
            raise KeyError("a failing step")
    assert F.scaled_dot_product_attention is original and current_positions() is None


def test_a_thread_running_a_backward_sees_the_steps_region_unless_it_keeps_to_its_own():
    """On CUDA, autograd's device thread recomputes a checkpointed block during backward, inside the region the
    training thread opened; another thread outside a backward, and each rank thread of `lightning_nd.check`, see
    none."""
    seen: dict[str, object] = {}

    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            return tensor.clone()

        @staticmethod
        def backward(ctx, grad):
            seen["backward"] = current_positions()
            return grad

    def autograd_thread() -> None:
        seen["forward"] = current_positions()
        ReadsInBackward.apply(torch.ones(1, requires_grad=True)).sum().backward()

    def check_rank() -> None:
        regions_of_this_thread_only()
        ReadsInBackward.apply(torch.ones(1, requires_grad=True)).sum().backward()
        seen["rank"] = seen.pop("backward")

    def in_thread(target) -> None:
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()

    with context_parallel_region(None, torch.arange(4)):
        with context_parallel_region(None, torch.arange(2)):
            in_thread(check_rank)
            in_thread(autograd_thread)
            assert seen["backward"].tolist() == [0, 1] and seen["forward"] is None and seen["rank"] is None
        in_thread(autograd_thread)
        assert seen["backward"].tolist() == [0, 1, 2, 3]
    assert current_positions() is None


def test_a_forward_step_without_routed_attention_is_refused():
    with pytest.raises(ValueError, match="no `torch.nn.functional.scaled_dot_product_attention`.*HINT"):
        with context_parallel_region(None, torch.arange(4), expect_attention=True):
            torch.nn.Linear(2, 2)(torch.zeros(1, 2))


def test_labels_given_to_the_model_are_refused_under_cp():
    model = build("hf_llama")
    model.register_forward_pre_hook(inject_positions, with_kwargs=True)
    tokens = torch.zeros(2, 4, dtype=torch.long)
    with context_parallel_region(None, torch.arange(4)), pytest.raises(ValueError, match="labels.*HINT.*shift_labels"):
        model(tokens, labels=tokens)


def test_labels_with_targets_shifted_before_the_split_pass_under_cp():
    model, tokens = build("hf_llama"), torch.zeros(2, 4, dtype=torch.long)
    with context_parallel_region(None, torch.arange(4)):
        args, kwargs = inject_positions(model, (tokens,), {"labels": tokens, "shift_labels": tokens})
    assert kwargs["shift_labels"] is tokens and kwargs["position_ids"].tolist() == [[0, 1, 2, 3]] * 2


def test_a_padded_batch_is_refused_under_cp():
    batch = {"tokens": torch.zeros(2, 8, dtype=torch.long), "attention_mask": torch.tensor([[1] * 8, [1] * 6 + [0] * 2])}
    with pytest.raises(ValueError, match="padding.*HINT"):
        shard_batch(batch, 2, 0, None)


class Embedder(torch.nn.Module):
    """Takes `position_ids`; with ``pool`` it averages over the sequence (under cp: over its shard only)."""

    def __init__(self, pool: bool) -> None:
        super().__init__()
        self.embed, self.pool, self.positions = torch.nn.Embedding(16, 8), pool, None

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        self.positions = position_ids
        x = self.embed(tokens)
        return x.mean(1) if self.pool else x


def test_a_model_pooling_over_its_shard_is_refused_at_its_first_call():
    pooled, per_token = Embedder(pool=True), Embedder(pool=False)
    for model in (pooled, per_token):
        attach_position_hooks(model, "position_ids")
    tokens = torch.zeros(2, 4, dtype=torch.long)
    assert pooled(tokens).shape == (2, 8)  # outside the region: the whole sequence, nothing to check
    with context_parallel_region(None, torch.tensor([0, 1, 6, 7])):
        with pytest.raises(ValueError, match=r"\(2, 8\) output for this rank's 4 tokens.*HINT.*cp=1"):
            pooled(tokens)
        assert pooled(torch.zeros(2, 3, dtype=torch.long)).shape == (2, 8)  # not a call on the shard
        assert per_token(tokens).shape == (2, 4, 8)
    assert per_token.positions.tolist() == [[0, 1, 6, 7]] * 2


def test_a_model_that_handles_positions_itself_gets_no_hooks():
    model = Embedder(pool=True)
    attach_position_hooks(model, "model")
    with context_parallel_region(None, torch.arange(4)):
        assert model(torch.zeros(2, 4, dtype=torch.long)).shape == (2, 8)
    assert model.positions is None


def test_the_multihead_attention_fast_path_is_off_inside_the_region():
    """Its fused inference kernel never calls SDPA, so it would attend within the shard."""
    assert torch.backends.mha.get_fastpath_enabled()
    with context_parallel_region(None, torch.arange(4)):
        assert not torch.backends.mha.get_fastpath_enabled()
    assert torch.backends.mha.get_fastpath_enabled()


def test_the_plan_says_how_the_model_gets_its_positions_or_refuses():
    from lightning_nd import ParallelConfig, ParallelDims, plan_layout
    from tests.unit.bad_models import LearnedPositions

    dims = ParallelDims(cp=2, dp_shard=1, world_size=2)
    cp = lambda layout: next(t for t in layout.techniques if t.technique == "context_parallel").describe()  # noqa: E731
    handled = plan_layout(build("hf_llama"), dims, ParallelConfig())
    assert cp(handled).endswith("`LlamaForCausalLM` gets global `position_ids`")
    with pytest.raises(ValueError, match="takes no `position_ids`.*`pos_emb`.*HINT"):
        plan_layout(LearnedPositions(), dims, ParallelConfig())
    opted_out = plan_layout(LearnedPositions(), dims, ParallelConfig(cp_positions="model"))
    assert cp(opted_out).endswith("finds its global positions itself (cp_positions='model')")
    assert opted_out.options.cp_positions == "model"


def test_torch_transformer_attention_is_routed_causal_in_training_and_evaluation(monkeypatch):
    """`nn.MultiheadAttention` calls SDPA; a causal mask `nn.TransformerEncoder` recognises becomes `is_causal`, and
    without the region's switch the evaluation fast path would skip SDPA altogether."""
    from lightning_nd.context_parallel import region

    routed, plain = [], F.scaled_dot_product_attention

    def fake_ring(query, key, value, positions, group, causal, scale, report, every_position):
        routed.append(causal)
        return plain(query, key, value, is_causal=causal, scale=scale)

    monkeypatch.setattr(region, "ring_attention", fake_ring)
    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x, mask = torch.randn(2, 4, 8), torch.nn.Transformer.generate_square_subsequent_mask(4)
    expected = encoder(x, mask=mask)
    for training in (True, False):
        encoder.train(training)
        with torch.set_grad_enabled(training), context_parallel_region(None, torch.arange(4), expect_attention=True):
            torch.testing.assert_close(encoder(x, mask=mask), expected)
    assert routed == [True] * 4
