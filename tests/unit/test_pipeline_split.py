"""Where models split into pipeline stages, and that the stage modules, chained on one process,
compute exactly what the whole model computes (outputs and gradients), holding only their own weights."""

from __future__ import annotations

import pytest
import torch

from lightning_nd.parallel.pipeline.stage import PipelineStages, StageModule, pack_inputs
from lightning_nd.parallel.pipeline.schedule import check_schedule, theoretical_bubble
from lightning_nd.layout.pipeline_split import balanced_counts, split_stages, stage_ranks
from lightning_nd.layout.structure import find_blocks
from tests.models import build


def test_balanced_split_gives_lighter_end_stages_when_they_carry_embeddings():
    assert balanced_counts([10] * 8, 4) == [2, 2, 2, 2]
    assert balanced_counts([10] * 8, 4, extra_first=15, extra_last=15) == [1, 3, 3, 1]
    assert balanced_counts([1, 1, 1, 9], 2) == [3, 1]


def test_stage_to_rank_mappings():
    assert stage_ranks(2, 1, "1f1b") == ((0,), (1,))
    assert stage_ranks(4, 2, "interleaved_1f1b") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert stage_ranks(2, 2, "zbv") == ((0, 3), (1, 2))


def test_schedule_defaults_and_bubble():
    assert check_schedule("1f1b", 4, None, None) == (1, 8)
    assert check_schedule("interleaved_1f1b", 2, None, None) == (2, 4)
    assert check_schedule("dualpipev", 2, None, None) == (2, 4)
    assert theoretical_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)


def test_split_sources():
    llama = build("llama8")
    layout = split_stages(llama, find_blocks(llama), 4)
    assert layout.pre == ("embed_tokens",) and layout.post == ("norm", "lm_head")
    assert "registration order" in layout.source
    assert [len([u for u in units if u.startswith("layers.")]) for units in layout.stages] == [2, 2, 2, 2]
    assert split_stages(llama, find_blocks(llama), 2, layers_per_stage=[3, 5]).stages[0] == (
        "embed_tokens", "layers.0", "layers.1", "layers.2")
    assert split_stages(llama, find_blocks(llama), 2, split_points=["layers.6"]).stages[1] == (
        "layers.6", "layers.7", "norm", "lm_head")
    hf = build("hf_llama")
    declared = split_stages(hf, find_blocks(hf), 2)
    assert "_pp_plan" in declared.source
    assert declared.pre == ("model.embed_tokens",) and declared.post == ("model.norm", "lm_head")


@pytest.mark.parametrize("model_name, num_stages", [("llama8", 2), ("llama8", 4), ("llama8", 8), ("hf_llama", 2)])
def test_chained_stages_compute_the_whole_model(model_name, num_stages):
    model = build(model_name)
    tokens = torch.randint(0, 256, (2, 12))
    expected = model(tokens)
    expected = getattr(expected, "logits", expected)
    expected.square().mean().backward()
    layout = split_stages(model, find_blocks(model), num_stages)
    stages = [StageModule(model, layout, index) for index in range(num_stages)]
    for stage in stages:
        stage.attach()
    carried: list[torch.Tensor] = []
    for stage in stages:
        output = stage(*carried, **pack_inputs(tokens))
        carried = [output]
    torch.testing.assert_close(carried[0], expected, rtol=0, atol=0)
    carried[0].square().mean().backward()
    names = {}
    for stage in stages:
        for name, param in stage.named_parameters(prefix="stages.0"):
            original = PipelineStages.original_name(name)
            assert original not in names, f"{original} is on two stages"
            names[original] = param
    whole = dict(model.named_parameters())
    assert names.keys() == whole.keys()
    for name, param in names.items():
        torch.testing.assert_close(param.grad, whole[name].grad, rtol=0, atol=0, msg=lambda m: f"grad {name}: {m}")


def test_a_stage_copies_only_its_own_weights():
    model = build("llama8")
    layout = split_stages(model, find_blocks(model), 4)
    total = sum(p.numel() for p in model.parameters())
    held = [sum(p.numel() for p in StageModule(model, layout, index).parameters()) for index in range(4)]
    assert sum(held) == total
    assert max(held) < 0.4 * total


class _NoHooks:
    """Stands in for a LightningModule without the two pipeline hooks."""


def test_default_batch_split_passes_every_other_key_as_a_keyword_input():
    from lightning_nd.strategy.pipeline_engine import split_batch

    tokens, labels, mask = torch.zeros(2, 4), torch.ones(2, 4), torch.ones(2, 4)
    inputs, target = split_batch(_NoHooks(), {"tokens": tokens, "labels": labels, "attention_mask": mask})
    assert set(inputs) == {"tokens", "attention_mask"} and target is labels
    assert split_batch(_NoHooks(), (tokens, labels)) == (tokens, labels)
    assert split_batch(_NoHooks(), tokens, need_target=False) == (tokens, None)


def test_hugging_face_batches_need_their_own_loss_hook():
    from lightning_nd.strategy.pipeline_engine import split_batch

    with pytest.raises(ValueError, match=r"unshifted.*HINT.*labels\[:, 1:\]"):
        split_batch(_NoHooks(), {"input_ids": torch.zeros(2, 4), "labels": torch.zeros(2, 4)})


def test_default_loss_ignores_padding_labels():
    from lightning_nd.strategy.pipeline_engine import pipeline_loss

    logits = torch.randn(2, 3, 5)
    target = torch.tensor([[1, 2, -100], [0, -100, 4]])
    keep = target != -100
    expected = torch.nn.functional.cross_entropy(logits[keep], target[keep])
    torch.testing.assert_close(pipeline_loss(_NoHooks(), logits, target), expected)
