"""The bad configurations of `test_errors.py`, as data: what a user passes to `NDParallel` (or to a Hydra
``parallel`` group), how many devices the Trainer gets (None: the constructor alone fails) and the LightningModule
connected (MODULE:FACTORY in `bad_models.py`, as the dry run's ``--model`` names it); then the exception type and
the facts its message must hold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.unit.bad_models import MIXER_PLAN

MODELS = "tests.unit.bad_models"


@dataclass(frozen=True)
class Case:
    name: str
    arguments: dict[str, Any]
    error: type[Exception]
    facts: tuple[str, ...]
    devices: int | None = None
    model: str | None = None

    def __str__(self) -> str:
        return self.name


def case(name: str, arguments: dict[str, Any], error: type[Exception], facts: list[str], devices: int | None = None,
         model: str | None = None) -> Case:
    return Case(name, arguments, error, tuple(facts), devices, f"{MODELS}:{model}" if model else None)


CASES = [
    case("world_size_mismatch", {"dp_shard": 2, "tp": 3}, ValueError, ["= 6", "world_size=4"], 4),
    case("dp_shard_cannot_fill", {"tp": 3}, ValueError, ["dp_shard=-1", "world_size=4"], 4),
    case("tp_zero", {"tp": 0}, ValueError, ["tp=0"]),
    case("tp_float", {"tp": 2.0}, TypeError, ["tp=2.0"]),
    case("dp_shard_minus_two", {"dp_shard": -2}, ValueError, ["dp_shard=-2"]),
    case("zero_stage_four", {"zero_stage": 4}, ValueError, ["zero_stage=4"]),
    case("activation_checkpointing_unknown", {"activation_checkpointing": "some"}, ValueError, ["'some'", "selective"]),
    case("sequence_parallel_without_tp", {"sequence_parallel": True}, ValueError, ["sequence_parallel=True", "tp=1"]),
    case("loss_parallel_without_tp", {"loss_parallel": True}, ValueError, ["loss_parallel=True", "tp=1"]),
    case("cp_with_compile", {"cp": 2, "compile": True}, ValueError, ["compile", "cp=2"]),
    case("cp_with_eager_attention", {"cp": 2, "dp_shard": 1}, ValueError, ["cp=2", "'eager'", "sdpa"], 2, "eager_llama"),
    case("cp_with_sliding_window", {"cp": 2, "dp_shard": 1}, ValueError, ["cp=2", "window of 8"], 2, "windowed_llama"),
    case("cp_with_attention_dropout", {"cp": 2, "dp_shard": 1}, ValueError, ["cp=2", "attention_dropout=0.1", "cp=1"], 2,
         "attention_dropout_llama"),
    case("cp_positions_from_the_local_length", {"cp": 2, "dp_shard": 1}, ValueError,
         ["cp=2", "`LearnedPositions.forward` takes no `position_ids`", "`pos_emb`", "cp_positions='model'"], 2,
         "learned_positions"),
    case("cp_torch_transformer", {"cp": 2, "dp_shard": 1}, ValueError,
         ["cp=2", "`pos_encoder` (PositionalEncoding)", "`transformer` (Transformer", "position_ids"], 2, "transformer"),
    case("cp_alibi_biases", {"cp": 2, "dp_shard": 1}, ValueError, ["cp=2", "`FalconForCausalLM`", "config.alibi=True"],
         2, "alibi_falcon"),
    case("cp_positions_unknown", {"cp_positions": "global"}, ValueError, ["'global'", "'model'"]),
    case("batch_norm_under_dp_shard", {"dp_shard": 2}, ValueError,
         ["dp_shard=2", "`model.blocks.0.norm` (BatchNorm1d)", "SyncBatchNorm"], 2, "batch_norm"),
    case("batch_norm_under_hsdp", {"dp_replicate": 2, "dp_shard": 2}, ValueError,
         ["dp_replicate=2, dp_shard=2", "BatchNorm1d"], 4, "batch_norm"),
    case("batch_norm_under_cp", {"cp": 2, "dp_shard": 1}, ValueError, ["`NDParallel(cp=2)`", "BatchNorm1d", "LayerNorm"],
         2, "batch_norm"),
    case("batch_norm_under_pp", {"pp": 2, "dp_shard": 1}, ValueError, ["`NDParallel(pp=2)`", "BatchNorm1d"], 2,
         "batch_norm"),
    case("batch_norm_under_sequence_parallel", {"tp": 2, "sequence_parallel": True, "tp_plan": MIXER_PLAN}, ValueError,
         ["sequence_parallel=True", "BatchNorm1d"], 2, "batch_norm"),
    case("sync_batch_norm_under_pp", {"pp": 2, "dp_shard": 1}, ValueError,
         ["pp=2", "SyncBatchNorm", "only its stage's ranks"], 2, "sync_batch_norm"),
    case("pp_torch_transformer", {"pp": 2, "dp_shard": 1}, ValueError,
         ["pp=2", "`model.transformer` is a `Transformer`", "indexes its first layer", "nn.ModuleList"], 2, "transformer"),
    case("hf_router_logits_under_pp", {"pp": 2, "dp_shard": 1}, ValueError,
         ["pp=2", "router_aux_loss_coef=0.001", "output_router_logits=False", "lightning_nd.nn.MoE"], 2,
         "router_logits_mixtral"),
    case("ep_with_compile", {"ep": 2, "compile": True}, ValueError, ["compile", "ep=2"]),
    case("ep_with_sequence_parallel", {"ep": 2, "tp": 2, "sequence_parallel": True}, ValueError,
         ["ep=2", "sequence_parallel=False"]),
    case("experts_under_sequence_parallel", {"tp": 2, "sequence_parallel": True}, ValueError,
         ["tp=2, sequence_parallel=True", "sequence_parallel=False"], 2, "six_experts"),
    case("ep_not_dividing_experts", {"ep": 4, "dp_shard": 4}, ValueError, ["ep=4", "6", "[1, 2, 3, 6]"], 4,
         "six_experts"),
    case("ep_experts_with_biases", {"ep": 2, "dp_shard": 2}, ValueError, ["gate_up_proj_bias", "ep=1"], 2,
         "biased_experts"),
    case("ep_with_cpu_offload", {"ep": 2, "cpu_offload": True}, ValueError, ["cpu_offload", "ep=2"]),
    case("ep_without_experts", {"ep": 2, "dp_shard": 2}, ValueError, ["ep=2", "no experts module"], 2, "llama"),
    case("compile_with_tp", {"tp": 2, "compile": True}, ValueError, ["tp=2", "wrong gradients"]),
    case("unknown_option_from_config", {"tp": 2, "sequence_paralel": True}, ValueError,
         ["sequence_paralel", "sequence_parallel"]),
    case("unknown_dim_name", {"dq": 2}, ValueError, ["`dq`", "`dp_"]),
    case("ep_minus_one", {"ep": -1}, ValueError, ["ep=-1"], 2),
    case("two_dims_fill", {"tp": -1}, ValueError, ["'dp_shard', 'tp'", "dp_shard=1"], 4),
    case("ep_not_dividing_dp_shard", {"ep": 3, "dp_shard": 4}, ValueError, ["ep=3", "[1, 2, 4]"], 4),
    case("tp_not_dividing_heads", {"tp": 3}, ValueError, ["tp=3", "num_attention_heads=8", "[1, 2, 4, 8]"], 3, "llama"),
    case("tp_not_dividing_kv_heads", {"tp": 8}, ValueError, ["tp=8", "num_key_value_heads=4", "[1, 2, 4]"], 8, "llama"),
    case("plan_style_typo", {"tp": 2, "tp_plan": {"model.layers.*.self_attn.q_proj": "colwize",
                                                  "model.layers.*.self_attn.o_proj": "rowwise"}},
         ValueError, ["'colwize'", "'colwise'"], 2, "llama"),
    case("plan_styles_all_typos", {"tp": 2, "tp_plan": {"model.layers.*.mlp.up_proj": "colwize",
                                                        "model.layers.*.mlp.down_proj": "rowwize"}},
         ValueError, ["'colwize'", "'colwise'"], 2, "llama"),
    case("plan_pattern_matches_nothing", {"tp": 2, "tp_plan": {"model.layers.*.attn.q_proj": "colwise"}}, ValueError,
         ["'model.layers.*.attn.q_proj'", "model.layers.0.self_attn.q_proj"], 2, "llama"),
    case("no_known_linear_names", {"tp": 2}, ValueError,
         ["model.blocks.0.alpha", "model.blocks.0.beta", "model.blocks.1.alpha", "model.blocks.1.beta",
          f"tp_plan={dict(reversed(MIXER_PLAN.items()))}"], 2, "reversed_mixer"),
    case("block_classes_not_in_model", {"block_classes": ["TransformerBlock"]}, ValueError,
         ["TransformerBlock", "DecoderLayer"], 2, "llama"),
    case("loss_parallel_with_tied_head", {"tp": 2, "loss_parallel": True}, ValueError, ["loss_parallel=True", "tied"],
         2, "gpt"),
    case("tp_plan_not_a_mapping", {"tp": 2, "tp_plan": ["model.layers.*.mlp.up_proj"]}, TypeError, ["tp_plan", "list"]),
    case("tp_plan_value_not_a_style", {"tp": 2, "tp_plan": {"model.layers.*.mlp.up_proj": 3}}, TypeError,
         ["model.layers.*.mlp.up_proj", "ParallelStyle"]),
    case("block_classes_not_classes", {"block_classes": [3]}, TypeError, ["block_classes=[3]"]),
    case("compile_backend_typo", {"compile": "indcutor"}, ValueError, ["'indcutor'", "'inductor'"]),
    case("zero_stage_bool", {"zero_stage": True}, ValueError, ["zero_stage=True"]),
    case("sequence_parallel_not_bool", {"tp": 2, "sequence_parallel": "yes"}, TypeError, ["sequence_parallel='yes'"]),
    case("meta_build_without_reset_parameters", {"tp": 2}, ValueError,
         ["ScaleNorm", "reset_parameters", "init_on_meta=False"], 2, "scale_norm_in_configure_model"),
    case("pp_zero_bubble_with_a_tie_inside_a_stage", {"pp": 2, "dp_shard": 1, "pp_schedule": "zbv"}, ValueError,
         ["pp_schedule='zbv'", "`model.blocks.0.ln_2.weight` is `model.blocks.0.ln_1.weight`", "interleaved_1f1b"], 2,
         "norms_tied_in_a_block"),
    case("meta_build_init_after_construction", {"dp_shard": 2}, ValueError,
         ["`model.tok.weight` (bad_models.py:", "in `configure_model`", "init_weights()", "self.apply",
          "init_on_meta=False"], 2, "init_after_construction"),
    case("colwise_out_features_not_divisible", {"tp": 8, "tp_plan": MIXER_PLAN}, ValueError,
         ["tp=8", "model.blocks.0.alpha", "out_features=12"], 8, "narrow_mixer"),
    case("pp_schedule_typo", {"pp": 2, "pp_schedule": "1f1f"}, ValueError, ["'1f1f'", "'1f1b'"]),
    case("pp_single_stage_schedule_with_two_stages", {"pp": 2, "pp_schedule": "gpipe", "pp_stages_per_rank": 2},
         ValueError, ["'gpipe'", "interleaved_1f1b"]),
    case("pp_v_schedule_needs_two_stages", {"pp": 2, "pp_schedule": "zbv", "pp_stages_per_rank": 3}, ValueError,
         ["'zbv'", "pp_stages_per_rank=2"]),
    case("pp_looped_schedule_needs_two_stages", {"pp": 2, "pp_schedule": "looped_bfs", "pp_stages_per_rank": 1},
         ValueError, ["'looped_bfs'", "pp_stages_per_rank=2"]),
    case("pp_too_few_microbatches", {"pp": 4, "pp_microbatches": 2}, ValueError, ["at least 4", "pp_microbatches=2"]),
    case("pp_microbatches_not_in_rounds", {"pp": 4, "pp_schedule": "interleaved_1f1b", "pp_microbatches": 9},
         ValueError, ["pp_microbatches=9", "multiple of 4"]),
    case("pp_microbatches_zero", {"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 0}, ValueError, ["0", "4"]),
    case("pp_with_zero1", {"pp": 2, "zero_stage": 1}, ValueError, ["zero_stage=1", "zero_stage=2"]),
    case("pp_with_compile", {"pp": 2, "compile": True}, ValueError, ["compile", "pp=2"]),
    case("pp_split_and_layers_per_stage", {"pp": 2, "pp_split": ["layers.1"], "pp_layers_per_stage": [1, 1]},
         ValueError, ["pp_layers_per_stage", "pp_split"]),
    case("pp_weight_shared_by_blocks_of_two_stages", {"pp": 2, "dp_shard": 1}, ValueError,
         ["`blocks.1.fc1.weight`", "`blocks.0.fc1.weight`", "stages 1 and 0", "tied input and output", "pp_split="],
         2, "blocks_sharing_a_weight"),
    case("pp_more_stages_than_blocks", {"pp": 2, "dp_shard": 1, "pp_schedule": "interleaved_1f1b"}, ValueError,
         ["4 pipeline stages", "has 2"], 2, "llama"),
    case("pp_layers_per_stage_wrong_sum", {"pp": 2, "dp_shard": 1, "pp_layers_per_stage": [1, 2]}, ValueError,
         ["[1, 2]", "[1, 1]"], 2, "llama"),
    case("pp_split_unknown_block", {"pp": 2, "dp_shard": 1, "pp_split": ["layers.9"]}, ValueError,
         ["'layers.9'", "'layers.1'"], 2, "llama"),
    case("pp_model_in_two_attributes", {"pp": 2, "dp_shard": 1}, ValueError, ["`model`", "`extra`", "one attribute"], 2,
         "two_models"),
]
