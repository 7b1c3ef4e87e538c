"""Where models split into pipeline stages, and that the stage modules, chained on one process,
compute exactly what the whole model computes (outputs and gradients), holding only their own weights."""

from __future__ import annotations

import pytest
import torch

from lightning_nd.model.structure import find_blocks
from lightning_nd.pipeline_parallel.schedules import check_schedule, theoretical_bubble
from lightning_nd.pipeline_parallel.split import balanced_counts, split_stages, stage_ranks
from lightning_nd.pipeline_parallel.stage import PipelineStages, StageModule, pack_inputs
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
    assert "the order the model's forward calls its units" in layout.source
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


class _LossOnly:
    """Stands in for a LightningModule with `pipeline_loss` and without `pipeline_inputs`."""

    def pipeline_loss(self, output, target): ...


def test_a_pipeline_loss_batch_is_a_pair_or_given_by_pipeline_inputs():
    from lightning_nd.strategy.pipeline_engine import split_batch

    tokens, labels = torch.zeros(2, 4), torch.ones(2, 4)
    assert split_batch(_LossOnly(), (tokens, labels)) == (tokens, labels)
    assert split_batch(_LossOnly(), tokens, need_target=False) == (tokens, None)
    module = _LossOnly()
    module.pipeline_inputs = lambda batch: (batch["tokens"], batch["labels"])
    assert split_batch(module, {"tokens": tokens, "labels": labels}) == (tokens, labels)


def test_a_dict_batch_is_never_split_by_its_key_names():
    from lightning_nd.strategy.pipeline_engine import split_batch

    with pytest.raises(ValueError, match=r"cannot tell inputs from target.*HINT: either define `def pipeline_inputs"
                                         r".*or remove `pipeline_loss`"):
        split_batch(_LossOnly(), {"input_ids": torch.zeros(2, 4), "labels": torch.zeros(2, 4)})


def test_tied_embeddings_are_one_copy_on_the_first_and_one_on_the_last_stage():
    from lightning_nd.layout.holdings import rank_holdings
    from lightning_nd.layout.record import StagePlan
    from lightning_nd.mesh.dims import ParallelDims

    model = build("gpt4")
    layout = split_stages(model, find_blocks(model), 4)
    assert layout.tied == (("tok.weight", "out.weight"),)
    assert "`out.weight` is tied to `tok.weight`: a copy on the first and the last stage" in layout.describe()
    first, last = StageModule(model, layout, 0), StageModule(model, layout, 3)
    assert first.module.get_parameter("tok.weight") is not last.module.get_parameter("out.weight")
    torch.testing.assert_close(last.module.get_parameter("out.weight"), model.tok.weight, rtol=0, atol=0)
    dims = ParallelDims(pp=2, dp_shard=2, world_size=4)
    plan = StagePlan("model", layout, stage_ranks(2, 2, "zbv"))
    holdings = rank_holdings(torch.nn.ModuleDict({"model": model}), dims, blocks=(), tp_entries={}, pipeline=plan,
                             experts=set())
    held = [{shard.name: shard for shard in holding.params} for holding in holdings]
    assert "model.tok.weight" in held[0] and "model.out.weight" in held[0]  # V-shaped: rank 0 holds both stages
    assert "model.tok.weight" not in held[2] and "model.out.weight" not in held[2]
    assert held[0]["model.out.weight"].local_shape == held[0]["model.tok.weight"].local_shape == (128, 32)
    assert held[0]["model.out.weight"].kind == "head"


def test_a_weight_shared_across_stages_other_than_first_and_last_is_refused():
    model = build("gpt4")
    model.blocks[2].fc1.weight = model.blocks[1].fc1.weight
    with pytest.raises(ValueError, match=r"`blocks.2.fc1.weight` and `blocks.1.fc1.weight` are one shared weight.*"
                                         r"stages 1 and 0.*HINT: move the stage boundary"):
        split_stages(model, find_blocks(model), 2, layers_per_stage=[2, 2])
    assert split_stages(model, find_blocks(model), 2, layers_per_stage=[3, 1]).tied == (("tok.weight", "out.weight"),)


def test_the_dry_run_says_a_hugging_face_gpt2_head_is_tied_and_held_by_the_last_stage(capsys):
    from lightning_nd.planner.__main__ import main

    config = '{"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 1000, "tie_word_embeddings": true}'
    assert main(["--hf-model-type", "gpt2", "--hf-kwargs", config, "--devices", "2", "--layout", "pp=2"]) == 0
    out = capsys.readouterr().out
    assert "`lm_head.weight` is tied to `transformer.wte.weight`: a copy on the first and the last stage" in out
    assert "Rank 1 (pp=1" in out and "| head | 1 | 64,000 |" in out  # the heaviest rank: the head's copy


def test_a_stage_hands_on_its_auxiliary_losses_without_returning_a_view():
    """`attach` (a stage's MoE losses riding on its output): the value is the output's, the losses get gradient
    ``scale``, and the tensor is no view (FSDP2 warned "FSDPStageModule returned a view tensor" on every MoE step
    under pp x dp_shard)."""
    from lightning_nd.pipeline_parallel.aux_losses import attach

    weight, coef = torch.randn(3, requires_grad=True), torch.tensor(2.0, requires_grad=True)
    output, aux = weight * 2, coef * 3
    handed = attach(output, aux, 0.25)
    assert handed._base is None and torch.equal(handed, output)
    (handed * 1).sum().backward()
    assert torch.equal(weight.grad, torch.full((3,), 2.0)) and coef.grad.item() == 0.75
