"""Every bad configuration fails before any process group exists, with the bad value and a HINT.

Each case is built exactly as a user would: `NDParallel(...)`, `Trainer(...)` (which validates the
dims against devices without launching anything) and `trainer.strategy.connect(module)` (the model
checks `fit` would run first). `Trainer.fit` is never called.
"""

from __future__ import annotations

import ast
import re

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

from examples.lit import CausalLM
from lightning_nd import NDParallel, ParallelConfig, ParallelDims
from lightning_nd.plan.__main__ import plan_for
from tests.models import build
from tests.unit.bad_models import (
    MIXER_PLAN, LearnedPositions, MixerNet, batch_norm_net, falcon_alibi, hf_llama, hf_mixtral_router_logits, moe,
    shared_blocks, torch_transformer, two_models,
)


def _trainer(devices: int, strategy: NDParallel) -> Trainer:
    return Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


def _connect(devices: int, strategy: NDParallel, model: nn.Module) -> None:
    _trainer(devices, strategy).strategy.connect(CausalLM(model=model))


CASES = [
    ("world_size_mismatch", lambda: _trainer(4, NDParallel(dp_shard=2, tp=3)),
     ValueError, ["= 6", "world_size=4"]),
    ("dp_shard_cannot_fill", lambda: _trainer(4, NDParallel(tp=3)),
     ValueError, ["dp_shard=-1", "world_size=4"]),
    ("tp_zero", lambda: NDParallel(tp=0), ValueError, ["tp=0"]),
    ("tp_float", lambda: NDParallel(tp=2.0), TypeError, ["tp=2.0"]),
    ("dp_shard_minus_two", lambda: NDParallel(dp_shard=-2), ValueError, ["dp_shard=-2"]),
    ("zero_stage_four", lambda: NDParallel(zero_stage=4), ValueError, ["zero_stage=4"]),
    ("activation_checkpointing_unknown", lambda: NDParallel(activation_checkpointing="some"),
     ValueError, ["'some'", "selective"]),
    ("sequence_parallel_without_tp", lambda: NDParallel(sequence_parallel=True),
     ValueError, ["sequence_parallel=True", "tp=1"]),
    ("loss_parallel_without_tp", lambda: NDParallel(loss_parallel=True),
     ValueError, ["loss_parallel=True", "tp=1"]),
    ("cp_with_compile", lambda: NDParallel(cp=2, compile=True), ValueError, ["compile", "cp=2"]),
    ("cp_with_eager_attention", lambda: _connect(2, NDParallel(cp=2, dp_shard=1), hf_llama(attn_implementation="eager")),
     ValueError, ["cp=2", "'eager'", "sdpa"]),
    ("cp_with_sliding_window", lambda: _connect(2, NDParallel(cp=2, dp_shard=1), hf_llama(sliding_window=8)),
     ValueError, ["cp=2", "window of 8"]),
    ("cp_positions_from_the_local_length", lambda: _connect(2, NDParallel(cp=2, dp_shard=1), LearnedPositions()),
     ValueError, ["cp=2", "`LearnedPositions.forward` takes no `position_ids`", "`pos_emb`", "cp_positions='model'"]),
    ("cp_torch_transformer", lambda: _connect(2, NDParallel(cp=2, dp_shard=1), torch_transformer()),
     ValueError, ["cp=2", "`pos_encoder` (PositionalEncoding)", "`transformer` (Transformer", "position_ids"]),
    ("cp_alibi_biases", lambda: _connect(2, NDParallel(cp=2, dp_shard=1), falcon_alibi()),
     ValueError, ["cp=2", "`FalconForCausalLM`", "config.alibi=True"]),
    ("cp_positions_unknown", lambda: ParallelConfig(cp_positions="global"), ValueError, ["'global'", "'model'"]),
    ("batch_norm_under_dp_shard", lambda: _connect(2, NDParallel(dp_shard=2), batch_norm_net()),
     ValueError, ["dp_shard=2", "`model.blocks.0.norm` (BatchNorm1d)", "SyncBatchNorm"]),
    ("batch_norm_under_hsdp", lambda: _connect(4, NDParallel(dp_replicate=2, dp_shard=2), batch_norm_net()),
     ValueError, ["dp_replicate=2, dp_shard=2", "BatchNorm1d"]),
    ("batch_norm_under_cp", lambda: _connect(2, NDParallel(cp=2, dp_shard=1), batch_norm_net()),
     ValueError, ["`NDParallel(cp=2)`", "BatchNorm1d", "LayerNorm"]),
    ("batch_norm_under_pp", lambda: _connect(2, NDParallel(pp=2, dp_shard=1), batch_norm_net()),
     ValueError, ["`NDParallel(pp=2)`", "BatchNorm1d"]),
    ("batch_norm_under_sequence_parallel", lambda: _connect(2, NDParallel(tp=2, sequence_parallel=True,
                                                                       tp_plan=MIXER_PLAN), batch_norm_net()),
     ValueError, ["sequence_parallel=True", "BatchNorm1d"]),
    ("sync_batch_norm_under_pp", lambda: _connect(2, NDParallel(pp=2, dp_shard=1), batch_norm_net(nn.SyncBatchNorm)),
     ValueError, ["pp=2", "SyncBatchNorm", "only its stage's ranks"]),
    ("pp_torch_transformer", lambda: _connect(2, NDParallel(pp=2, dp_shard=1), torch_transformer()),
     ValueError, ["pp=2", "`model.transformer` is a `Transformer`", "indexes its first layer", "nn.ModuleList"]),
    ("hf_router_logits_under_pp", lambda: _connect(2, NDParallel(pp=2, dp_shard=1), hf_mixtral_router_logits()),
     ValueError, ["pp=2", "router_aux_loss_coef=0.001", "output_router_logits=False", "lightning_nd.nn.MoE"]),
    ("ep_with_compile", lambda: NDParallel(ep=2, compile=True), ValueError, ["compile", "ep=2"]),
    ("ep_with_sequence_parallel", lambda: NDParallel(ep=2, tp=2, sequence_parallel=True), ValueError,
     ["ep=2", "sequence_parallel=False"]),
    ("ep_not_dividing_experts", lambda: _connect(4, NDParallel(ep=4, dp_shard=4), moe(6)), ValueError,
     ["ep=4", "6", "[1, 2, 3, 6]"]),
    ("ep_experts_with_biases", lambda: _connect(2, NDParallel(ep=2, dp_shard=2), moe(8, bias=True)), ValueError,
     ["gate_up_proj_bias", "ep=1"]),
    ("ep_with_cpu_offload", lambda: NDParallel(ep=2, cpu_offload=True), ValueError, ["cpu_offload", "ep=2"]),
    ("ep_without_experts", lambda: _connect(2, NDParallel(ep=2, dp_shard=2), build("llama")), ValueError,
     ["ep=2", "no experts module"]),
    ("compile_with_tp", lambda: NDParallel(tp=2, compile=True), ValueError, ["tp=2", "wrong gradients"]),
    ("unknown_option_from_config", lambda: NDParallel.from_config({"tp": 2, "sequence_paralel": True}),
     ValueError, ["sequence_paralel", "sequence_parallel"]),
    ("unknown_dim_name", lambda: ParallelDims.from_mapping({"dq": 2}, world_size=2),
     ValueError, ["`dq`", "`dp_"]),
    ("ep_minus_one", lambda: ParallelDims(ep=-1, world_size=2), ValueError, ["ep=-1"]),
    ("two_dims_fill", lambda: ParallelDims(tp=-1, world_size=4), ValueError, ["'dp_shard', 'tp'", "dp_shard=1"]),
    ("ep_not_dividing_dp_shard", lambda: ParallelDims(ep=3, dp_shard=4, world_size=4),
     ValueError, ["ep=3", "[1, 2, 4]"]),
    ("tp_not_dividing_heads", lambda: _connect(3, NDParallel(tp=3), build("llama")),
     ValueError, ["tp=3", "num_attention_heads=8", "[1, 2, 4, 8]"]),
    ("tp_not_dividing_kv_heads", lambda: _connect(8, NDParallel(tp=8), build("llama")),
     ValueError, ["tp=8", "num_key_value_heads=4", "[1, 2, 4]"]),
    ("plan_style_typo", lambda: _connect(2, NDParallel(tp=2, tp_plan={
        "model.layers.*.self_attn.q_proj": "colwize", "model.layers.*.self_attn.o_proj": "rowwise"}), build("llama")),
     ValueError, ["'colwize'", "'colwise'"]),
    ("plan_styles_all_typos", lambda: _connect(2, NDParallel(tp=2, tp_plan={
        "model.layers.*.mlp.up_proj": "colwize", "model.layers.*.mlp.down_proj": "rowwize"}), build("llama")),
     ValueError, ["'colwize'", "'colwise'"]),
    ("plan_pattern_matches_nothing", lambda: _connect(2, NDParallel(tp=2, tp_plan={
        "model.layers.*.attn.q_proj": "colwise"}), build("llama")),
     ValueError, ["'model.layers.*.attn.q_proj'", "model.layers.0.self_attn.q_proj"]),
    ("no_known_linear_names", lambda: _connect(2, NDParallel(tp=2), MixerNet()),
     ValueError, ["model.blocks.0.alpha", "model.blocks.0.beta", "model.blocks.1.alpha", "model.blocks.1.beta",
                  f"tp_plan={MIXER_PLAN}"]),
    ("block_classes_not_in_model", lambda: _connect(2, NDParallel(block_classes=["TransformerBlock"]), build("llama")),
     ValueError, ["TransformerBlock", "DecoderLayer"]),
    ("loss_parallel_with_tied_head", lambda: _connect(2, NDParallel(tp=2, loss_parallel=True), build("gpt")),
     ValueError, ["loss_parallel=True", "tied"]),
    ("tp_plan_not_a_mapping", lambda: NDParallel(tp=2, tp_plan=["model.layers.*.mlp.up_proj"]),
     TypeError, ["tp_plan", "list"]),
    ("tp_plan_value_not_a_style", lambda: NDParallel(tp=2, tp_plan={"model.layers.*.mlp.up_proj": 3}),
     TypeError, ["model.layers.*.mlp.up_proj", "ParallelStyle"]),
    ("block_classes_not_classes", lambda: NDParallel(block_classes=[3]), TypeError, ["block_classes=[3]"]),
    ("compile_backend_typo", lambda: NDParallel(compile="indcutor"), ValueError, ["'indcutor'", "'inductor'"]),
    ("zero_stage_bool", lambda: NDParallel(zero_stage=True), ValueError, ["zero_stage=True"]),
    ("sequence_parallel_not_bool", lambda: NDParallel(tp=2, sequence_parallel="yes"),
     TypeError, ["sequence_parallel='yes'"]),
    ("meta_build_without_reset_parameters",
     lambda: _trainer(2, NDParallel(tp=2)).strategy.connect(CausalLM(model_factory=lambda: build("hf_llama"))),
     ValueError, ["LlamaRotaryEmbedding", "reset_parameters", "init_on_meta=False"]),
    ("colwise_out_features_not_divisible", lambda: _connect(8, NDParallel(tp=8, tp_plan=MIXER_PLAN), MixerNet(16, 12)),
     ValueError, ["tp=8", "model.blocks.0.alpha", "out_features=12"]),
    ("pp_schedule_typo", lambda: NDParallel(pp=2, pp_schedule="1f1f"), ValueError, ["'1f1f'", "'1f1b'"]),
    ("pp_single_stage_schedule_with_two_stages", lambda: NDParallel(pp=2, pp_schedule="gpipe", pp_stages_per_rank=2),
     ValueError, ["'gpipe'", "interleaved_1f1b"]),
    ("pp_v_schedule_needs_two_stages", lambda: NDParallel(pp=2, pp_schedule="zbv", pp_stages_per_rank=3),
     ValueError, ["'zbv'", "pp_stages_per_rank=2"]),
    ("pp_looped_schedule_needs_two_stages", lambda: NDParallel(pp=2, pp_schedule="looped_bfs", pp_stages_per_rank=1),
     ValueError, ["'looped_bfs'", "pp_stages_per_rank=2"]),
    ("pp_too_few_microbatches", lambda: NDParallel(pp=4, pp_microbatches=2), ValueError, ["at least 4", "pp_microbatches=2"]),
    ("pp_microbatches_not_in_rounds", lambda: NDParallel(pp=4, pp_schedule="interleaved_1f1b", pp_microbatches=9),
     ValueError, ["pp_microbatches=9", "multiple of 4"]),
    ("pp_microbatches_zero", lambda: NDParallel(pp=2, pp_schedule="gpipe", pp_microbatches=0), ValueError, ["0", "4"]),
    ("pp_with_zero1", lambda: NDParallel(pp=2, zero_stage=1), ValueError, ["zero_stage=1", "zero_stage=2"]),
    ("pp_with_compile", lambda: NDParallel(pp=2, compile=True), ValueError, ["compile", "pp=2"]),
    ("pp_split_and_layers_per_stage", lambda: NDParallel(pp=2, pp_split=["layers.1"], pp_layers_per_stage=[1, 1]),
     ValueError, ["pp_layers_per_stage", "pp_split"]),
    ("pp_weight_shared_by_blocks_of_two_stages", lambda: _connect(2, NDParallel(pp=2, dp_shard=1), shared_blocks()),
     ValueError, ["`blocks.1.fc1.weight`", "`blocks.0.fc1.weight`", "stages 1 and 0", "tied input and output",
                  "pp_split="]),
    ("pp_more_stages_than_blocks",
     lambda: _connect(2, NDParallel(pp=2, dp_shard=1, pp_schedule="interleaved_1f1b"), build("llama")),
     ValueError, ["4 pipeline stages", "has 2"]),
    ("pp_layers_per_stage_wrong_sum", lambda: _connect(2, NDParallel(pp=2, dp_shard=1, pp_layers_per_stage=[1, 2]),
                                                       build("llama")), ValueError, ["[1, 2]", "[1, 1]"]),
    ("pp_split_unknown_block", lambda: _connect(2, NDParallel(pp=2, dp_shard=1, pp_split=["layers.9"]), build("llama")),
     ValueError, ["'layers.9'", "'layers.1'"]),
    ("pp_model_in_two_attributes", lambda: _trainer(2, NDParallel(pp=2, dp_shard=1)).strategy.connect(two_models()),
     ValueError, ["`model`", "`extra`", "one attribute"]),
]


@pytest.mark.parametrize(("make", "error", "facts"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_configuration_raises_with_the_facts_and_a_hint(make, error, facts):
    with pytest.raises(error) as raised:
        make()
    message = str(raised.value)
    for fact in [*facts, "HINT"]:
        assert fact in message, f"{fact!r} missing from: {message}"
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("make", [case[1] for case in CASES], ids=[case[0] for case in CASES])
def test_the_dry_run_raises_the_same_error(make, monkeypatch):
    """`python -m lightning_nd.plan` runs the same checks in the same order: the same type, the same message."""
    with pytest.raises(Exception) as through_trainer:
        make()
    module = __import__(__name__, fromlist=["_trainer"])
    monkeypatch.setattr(module, "_trainer", lambda devices, strategy: _Planned(devices, strategy))
    monkeypatch.setattr(module, "_connect", lambda devices, strategy, model: plan_for(strategy, devices, CausalLM(model=model)))
    with pytest.raises(Exception) as through_dry_run:
        make()
    assert type(through_dry_run.value) is type(through_trainer.value)
    assert str(through_dry_run.value) == str(through_trainer.value)


class _Planned:
    """What the dry run does where a case builds a Trainer: check the dims against the devices; `connect`
    then plans the module."""

    def __init__(self, devices: int, strategy: NDParallel) -> None:
        plan_for(strategy, devices, None)
        self.strategy = self
        self._devices, self._nd = devices, strategy

    def connect(self, module: nn.Module) -> None:
        plan_for(self._nd, self._devices, module)


def test_the_same_setups_with_good_values_connect():
    """The model cases above fail for the stated reason, not because connect fails without a process group."""
    _connect(2, NDParallel(tp=2), build("llama"))
    _connect(4, NDParallel(tp=4), build("llama"))
    _connect(2, NDParallel(tp=2, block_classes=["DecoderLayer"]), build("llama"))
    _connect(4, NDParallel(tp=4, tp_plan=MIXER_PLAN), MixerNet(16, 12))
    _connect(2, NDParallel(pp=2, dp_shard=1), build("llama"))
    _connect(2, NDParallel(pp=-1, dp_shard=1, pp_layers_per_stage=[1, 1]), build("llama"))
    _connect(2, NDParallel(pp=2, dp_shard=1, pp_split=["layers.1"]), build("llama"))
    _connect(4, NDParallel(ep=4, dp_shard=4), moe(8))
    _connect(2, NDParallel(ep=2, dp_shard=2), build("hf_mixtral"))
    _connect(2, NDParallel(tp=2, tp_plan=MIXER_PLAN), batch_norm_net())  # tp alone gives BatchNorm the whole batch
    _connect(2, NDParallel(dp_shard=2), batch_norm_net(nn.SyncBatchNorm))
    _connect(2, NDParallel(dp_shard=2), LearnedPositions())
    _connect(2, NDParallel(cp=2, dp_shard=1), build("gpt"))  # learned positions, taken from `position_ids`
    assert not torch.distributed.is_initialized()


def test_the_suggested_plan_can_be_copied():
    with pytest.raises(ValueError) as raised:
        _connect(2, NDParallel(tp=2), MixerNet())
    suggested = ast.literal_eval(re.search(r"tp_plan=(\{.*?\})", str(raised.value)).group(1))
    trainer = _trainer(2, NDParallel(tp=2, tp_plan=suggested))
    trainer.strategy.connect(CausalLM(model=MixerNet()))
    assert not torch.distributed.is_initialized()
