"""`plan_layout` alone (no process group): one frozen record, the same for a meta-device and a real model,
through JSON and back; the options stay as given; TP entries carry their source; roles follow coordinates."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from examples.lit import CausalLM
from lightning_nd import Layout, ParallelConfig, ParallelDims, plan_layout
from lightning_nd.layout.holdings import chunk_length
from lightning_nd.layout.plan import PlanMemo, _numel
from lightning_nd.mesh.roles import group_of, role_names
from tests.models import build

CASES = {
    "llama-tp2-pp2-fsdp2": ("llama", {"tp": 2, "pp": 2, "dp_shard": 2}, {}),
    "llama-hsdp-sp": ("llama", {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, {"sequence_parallel": True}),
    "gpt-cp2-fsdp4": ("gpt", {"cp": 2, "dp_shard": 4}, {}),
    "hf_llama-tp4-loss": ("hf_llama", {"tp": 4, "dp_shard": 2}, {"loss_parallel": True}),
    "moe-ep4-fsdp8": ("moe_llama", {"ep": 4, "dp_shard": 8}, {}),
    "moe-ep2-hsdp": ("moe_llama", {"ep": 2, "dp_replicate": 2, "dp_shard": 4}, {}),
    "llama8-interleaved": ("llama8", {"pp": 4, "dp_shard": 2}, {"pp_schedule": "interleaved_1f1b"}),
}


def _plan(model_name: str, sizes: dict, options: dict, world: int = 8, meta: bool = False) -> Layout:
    if meta:
        with torch.device("meta"):
            model = build(model_name)
    else:
        model = build(model_name)
    return plan_layout(CausalLM(model=model), ParallelDims(**sizes, world_size=world), ParallelConfig(**options))


@pytest.mark.parametrize("case", list(CASES))
def test_layout_round_trips_through_json_and_is_the_same_on_the_meta_device(case):
    layout = _plan(*CASES[case])
    again = Layout.from_json(layout.to_json())
    assert again == layout and again.to_dict() == layout.to_dict()
    assert _plan(*CASES[case], meta=True) == layout
    assert len(layout.ranks) == layout.dims["world_size"] and all(r.params for r in layout.ranks)


def test_every_parameter_is_held_and_its_shards_add_up():
    """pp=2 x dp_shard=2 x tp=2: the four ranks of a stage hold each of its parameters in FSDP shards, split by
    tp or copied on both tp ranks, so the elements held add up to the whole (twice for a tp copy)."""
    layout = _plan("llama", {"tp": 2, "pp": 2, "dp_shard": 2}, {})
    whole = {name: p.numel() for name, p in CausalLM(model=build("llama")).named_parameters()}
    held: dict[str, int] = {}
    tp_split: dict[str, bool] = {}
    for holding in layout.ranks:
        for shard in holding.params:
            held[shard.name] = held.get(shard.name, 0) + int(torch.Size(shard.local_shape).numel())
            tp_split[shard.name] = "tp:" in shard.placement
    assert held == {name: count * (1 if tp_split[name] else 2) for name, count in whole.items()}
    assert sum(tp_split.values()) > len(tp_split) // 2


def test_chunks_follow_torch_chunk():
    for size in range(0, 13):
        for chunks in range(1, 6):
            expected = [piece.shape[0] for piece in torch.arange(size).chunk(chunks)] if size else []
            expected += [0] * (chunks - len(expected))
            assert [chunk_length(size, chunks, i) for i in range(chunks)] == expected, (size, chunks)


def test_planning_leaves_the_config_as_given_and_resolves_the_defaults():
    config = ParallelConfig(pp_schedule="interleaved_1f1b", block_classes="DecoderLayer")
    before = copy.deepcopy(vars(config))
    layout = plan_layout(CausalLM(model=build("llama8")), ParallelDims(pp=2, dp_shard=2, world_size=4), config)
    assert vars(config) == before
    assert layout.options_given["zero_stage"] is None and layout.options_given["pp_microbatches"] is None
    assert (layout.options.zero_stage, layout.options.pp_stages_per_rank, layout.options.pp_microbatches) == (
        2, 2, 4)
    bf16 = plan_layout(CausalLM(model=build("llama")), ParallelDims(world_size=2), ParallelConfig(),
                       precision="bf16-mixed")
    assert (bf16.options.param_dtype, bf16.options.reduce_dtype, bf16.options.zero_stage) == (
        "bfloat16", "float32", 3)
    assert {shard.dtype for shard in bf16.rank(0).params} == {"float32"}  # FSDP keeps fp32 shards under bf16-mixed
    true_bf16 = plan_layout(CausalLM(model=build("llama")), ParallelDims(world_size=2), ParallelConfig(),
                            precision="bf16-true")
    assert true_bf16.rank(0).param_bytes * 2 == bf16.rank(0).param_bytes


def test_tp_entries_name_their_source():
    model = CausalLM(model=build("llama"))
    explicit = plan_layout(model, ParallelDims(tp=2, world_size=2), ParallelConfig(
        tp_plan={"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}))
    assert {e.source for e in explicit.tp} == {"explicit"} and len(explicit.tp) == 4
    patterns = plan_layout(model, ParallelDims(tp=2, world_size=2), ParallelConfig(sequence_parallel=True))
    sources = {e.module: e.source for e in patterns.tp}
    assert sources["model.layers.0.self_attn.q_proj"] == "pattern"
    assert sources["model.norm"] == "sequence_parallel" and sources["model.layers.1.input_norm"] == "sequence_parallel"
    declared = plan_layout(CausalLM(model=build("hf_llama")), ParallelDims(tp=2, world_size=2), ParallelConfig())
    assert {e.source for e in declared.tp} == {"declared"}
    styles = {e.module: e.style for e in declared.tp}
    assert styles["model.model.layers.0.self_attn.o_proj"] == "rowwise"


def test_records_of_the_techniques_in_the_composers_order():
    layout = _plan("moe_llama", {"ep": 2, "pp": 2, "dp_shard": 2, "tp": 2}, {"activation_checkpointing": "full"}, 8)
    assert [t.technique for t in layout.techniques] == [
        "pipeline_split", "expert_parallel", "expert_tensor_parallel", "tensor_parallel", "activation_checkpointing",
        "fsdp"]  # one rank per expert in its ep group (ep = dp_shard): each expert is split over tp too
    experts = layout.techniques[1]
    assert experts.role == "ep" and len(experts.modules) == 2 and experts.parameters > 0
    assert all(e.local_experts == 4 and e.sharded_over is None for e in layout.experts)


@pytest.mark.parametrize("sizes", [{"dp_shard": 2, "cp": 2, "tp": 2, "ep": 4}, {"pp": 2, "dp_replicate": 2, "tp": 2},
                                   {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "ep": 2}])
def test_role_groups_follow_the_coordinates(sizes):
    dims = ParallelDims(**sizes, world_size=8)
    varying = {"batch": {"dp_replicate", "dp_shard"}, "fsdp": {"dp_shard", "cp"},
               "loss": {"dp_replicate", "dp_shard", "cp"}, "tp": {"tp"}, "pp": {"pp"}}
    for rank in range(8):
        mine = dims.coordinates(rank)
        for role, free in varying.items():
            expected = [r for r in range(8) if all(dims.coordinates(r)[d] == mine[d]
                                                   for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if d not in free)]
            assert group_of(dims, role, rank) == expected, (role, rank)
        if dims.ep > 1:
            group = group_of(dims, "ep", rank)
            assert sorted(dims.coordinates(r)["ep"] for r in group) == list(range(dims.ep))
            experts_same = group_of(dims, "expert_dp", rank)
            assert all(dims.coordinates(r)["ep"] == mine["ep"] for r in experts_same)
            assert len(experts_same) == 8 // dims.tp // dims.pp // dims.ep
    assert ("ep" in role_names(dims)) == (dims.ep > 1)


def test_plans_sharing_a_memo_are_the_plans_made_alone():
    """The planner's `PlanMemo`: the same module planned under many layouts (tp 1 and 2, with and without sequence
    parallelism, pp splits, ep, an explicit plan) gives each the Layout a plan of its own gives, and a layout that is
    refused is refused again on the next plan that meets it, with the same message."""
    memo, module = PlanMemo(), CausalLM(model=build("moe_llama"))
    explicit = {"tp_plan": {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}}
    trials = [({"tp": 2, "dp_shard": 4}, {}), ({"tp": 2, "pp": 2, "dp_shard": 2}, {}), ({"pp": 2, "dp_shard": 4}, {"pp_layers_per_stage": [1, 1]}),
              ({"pp": 2, "dp_shard": 4}, {}), ({"ep": 2, "dp_shard": 8}, {}), ({"tp": 2, "dp_shard": 4}, explicit),
              ({"tp": 2, "ep": 2, "dp_shard": 2, "dp_replicate": 2}, {}), ({"dp_shard": 8}, {})]
    for sizes, options in trials * 2:
        dims, config = ParallelDims(**sizes, world_size=8), ParallelConfig(**options)
        assert plan_layout(module, dims, config, memo=memo) == plan_layout(module, dims, config), (sizes, options)
    dense, dense_memo = CausalLM(model=build("llama")), PlanMemo()  # MoE layers are refused under SP
    for options in [{"sequence_parallel": True}, {}] * 2:
        dims, config = ParallelDims(tp=2, dp_shard=4, world_size=8), ParallelConfig(**options)
        assert plan_layout(dense, dims, config, memo=dense_memo) == plan_layout(dense, dims, config), options
    bad = ParallelDims(tp=4, dp_shard=2, world_size=8), ParallelConfig()  # 2 kv heads do not split over 4 ranks
    messages = []
    for _ in range(2):
        with pytest.raises(ValueError) as refused:
            plan_layout(module, *bad, memo=memo)
        messages.append(str(refused.value))
    with pytest.raises(ValueError) as alone:
        plan_layout(module, *bad)
    assert messages == [str(alone.value)] * 2 and "HINT" in messages[0]


def test_the_parameters_a_technique_counts_are_its_modules_parameters():
    model = CausalLM(model=build("gpt4"))  # the head's weight is the embedding's: counted for each of the two
    leaves = [name for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    names = [*leaves, "model.blocks.0", "model.blocks.0.attn"]  # a block and a module inside it: each counts its own
    expected = sum(p.numel() for name in names for p in model.get_submodule(name).parameters())
    assert expected > sum(p.numel() for p in model.parameters())  # the tie and the nesting are both counted
    assert _numel(model, names) == expected and _numel(model, [""]) == sum(p.numel() for p in model.parameters())


def test_layout_files_written_before_the_typed_options_load_and_write_back_the_same():
    from lightning_nd.layout.options import ResolvedOptions

    files = sorted((Path(__file__).parents[1] / "data" / "traces").glob("*/layout.json"))
    assert len(files) >= 7
    for path in files:
        values = json.loads(path.read_text())
        layout = Layout.from_json(path.read_text())
        assert isinstance(layout.options, ResolvedOptions)
        assert json.loads(layout.to_json()) == values, path
    older = {key: value for key, value in values["options"].items() if key not in ("cp_positions", "reduce_dtype")}
    options = ResolvedOptions.from_dict({**older, "a_later_option": 1})
    assert (options.cp_positions, options.reduce_dtype) == ("position_ids", None)
    assert options.to_dict().keys() == values["options"].keys()


def test_the_resolved_options_are_typed_and_frozen():
    layout = plan_layout(build("llama"), ParallelDims(dp_shard=2, tp=2, world_size=4),
                         ParallelConfig(block_classes=["DecoderLayer"]))
    assert layout.options.block_classes == ("DecoderLayer",) and layout.options.zero_stage == 3
    assert layout.to_dict()["options"]["block_classes"] == ["DecoderLayer"]
    with pytest.raises(AttributeError):
        layout.options.zero_stage = 2  # type: ignore[misc]
