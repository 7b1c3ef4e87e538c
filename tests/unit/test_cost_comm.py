"""`comm_per_step`: each dim's ring bytes against sums worked out by hand from the model's own parameters."""

from __future__ import annotations

import pytest
import torch

from examples.models.llama import Llama, LlamaConfig
from lightning_nd.cost.comm import comm_per_step
from lightning_nd.cost.shape import Workload, model_shape
from lightning_nd.planner.dry_run import dry_run
from lightning_nd.planner.source import Holder

CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4)
HIDDEN, LAYERS, VOCAB, KV_DIM = 256, 4, 1024, 128
BATCH, SEQ = 2, 32
TOKENS = BATCH * SEQ
ACTIVATION = TOKENS * HIDDEN * 4  # one fp32 hidden state of the batch
WORKLOAD = Workload(seq_len=SEQ, batch=BATCH)


def _model(**extra) -> Holder:
    with torch.device("meta"):
        return Holder(Llama(LlamaConfig(**CONFIG, **extra)))


DENSE, MOE = _model(), _model(num_experts=8, num_experts_per_tok=2)


def _numel(model: Holder, *prefixes: str) -> int:
    return sum(p.numel() for name, p in model.model.named_parameters() if name.startswith(prefixes or ("",)))


FULL_BYTES = 4 * _numel(DENSE)  # fp32: 2,885,888 parameters


def _traffic(sizes: dict, options: dict | None = None, devices: int = 4, model: Holder = DENSE,
             workload: Workload = WORKLOAD, precision: str | None = None, rank: int = 0) -> dict[str, tuple[int, int]]:
    layout = dry_run(model, devices, sizes, options or {}, precision=precision)
    traffic = comm_per_step(layout, model_shape(model.model), workload, rank)
    assert all(t.what for t in traffic.values())
    return {dim: (t.bytes, t.group_size) for dim, t in traffic.items()}


def test_zero3_gathers_twice_and_zero2_once():
    assert _traffic({"dp_shard": 4}) == {"fsdp": (3 * FULL_BYTES * 3 // 4, 4)}
    assert _traffic({"dp_shard": 4}, {"zero_stage": 2}) == {"fsdp": (2 * FULL_BYTES * 3 // 4, 4)}


def test_bf16_mixed_gathers_in_bf16_and_reduces_in_fp32():
    zero2 = _traffic({"dp_shard": 4}, {"zero_stage": 2}, precision="bf16-mixed")["fsdp"][0]
    zero3 = _traffic({"dp_shard": 4}, precision="bf16-mixed")["fsdp"][0]
    assert zero2 == (FULL_BYTES // 2 + FULL_BYTES) * 3 // 4
    assert zero3 == (2 * FULL_BYTES // 2 + FULL_BYTES) * 3 // 4


def test_accumulation_reduces_every_micro_step_at_zero_2_and_3_and_once_at_zero_1():
    twice = Workload(seq_len=SEQ, batch=BATCH, accumulation=2)
    assert _traffic({"dp_shard": 4}, workload=twice)["fsdp"][0] == 2 * 3 * FULL_BYTES * 3 // 4
    assert _traffic({"dp_shard": 4}, {"zero_stage": 2}, workload=twice)["fsdp"][0] == 2 * 2 * FULL_BYTES * 3 // 4
    assert _traffic({"dp_shard": 4}, {"zero_stage": 1}, workload=twice)["fsdp"][0] == 2 * FULL_BYTES * 3 // 4
    tp = _traffic({"tp": 4}, workload=twice)["tp"][0]
    assert tp == 2 * _traffic({"tp": 4})["tp"][0]


def test_hsdp_all_reduces_the_gradient_shard_across_replicas():
    traffic = _traffic({"dp_replicate": 2, "dp_shard": 2}, {"zero_stage": 2})
    assert traffic == {"fsdp": (2 * FULL_BYTES // 2, 2), "dp_replicate": (2 * (FULL_BYTES // 2) // 2, 2)}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_moves_four_activations_per_block_plus_embedding_head_and_logits(sequence_parallel):
    all_reduces = 4 * LAYERS + 2
    logits = TOKENS * VOCAB * 4
    expected = (2 * all_reduces * ACTIVATION + logits) * 3 // 4
    assert _traffic({"tp": 4}, {"sequence_parallel": sequence_parallel}) == {"tp": (expected, 4)}


def test_loss_parallel_keeps_the_logits_sharded():
    assert _traffic({"tp": 4}, {"loss_parallel": True})["tp"][0] == 2 * (4 * LAYERS + 2) * ACTIVATION * 3 // 4


def test_tp_times_fsdp_gathers_what_tp_leaves():
    traffic = _traffic({"dp_shard": 2, "tp": 2}, {"zero_stage": 2})
    norms = _numel(DENSE, "layers.0.input_norm", "layers.0.post_attention_norm") * LAYERS + HIDDEN  # whole on tp ranks
    tp_local = 4 * ((_numel(DENSE) - norms) // 2 + norms)
    assert traffic["fsdp"] == (2 * tp_local // 2, 2)
    assert traffic["tp"] == ((2 * (4 * LAYERS + 2) * ACTIVATION + TOKENS * VOCAB * 4) // 2, 2)


def test_pp_sends_each_microbatch_once_and_fsdp_gathers_once_per_stage():
    first_stage = 4 * _numel(DENSE, "embed_tokens", "layers.0.", "layers.1.")
    last_stage = 4 * _numel(DENSE, "layers.2.", "layers.3.", "norm", "lm_head")
    for rank, stage_bytes in ((0, first_stage), (2, last_stage)):  # rank 2 holds stage 1 (pp is the outer dim)
        traffic = _traffic({"pp": 2, "dp_shard": 2}, {"pp_microbatches": 2}, rank=rank)
        assert traffic == {"fsdp": (2 * stage_bytes // 2, 2), "pp": (ACTIVATION, 2)}
    zero3 = _traffic({"pp": 2, "dp_shard": 2}, {"pp_microbatches": 2, "zero_stage": 3})
    assert zero3["fsdp"][0] == (2 * 2 + 1) * first_stage // 2  # a gather per microbatch forward and backward


@pytest.mark.parametrize(("schedule", "sends"), [("interleaved_1f1b", 3), ("zbv", 2)])
def test_pp_sends_only_to_stages_on_another_rank(schedule, sends):
    """Interleaved: rank 0 runs stages 0 and 2, so 0->1, 2->3 and 2->1 cross; V-shaped: 0 and 3, 1->2 stays on
    rank 1, so only 0->1 and 3->2 cross."""
    traffic = _traffic({"pp": 2, "dp_shard": 2}, {"pp_schedule": schedule, "pp_microbatches": 2})
    assert traffic["pp"] == (sends * ACTIVATION, 2)


def test_pp_adds_the_tied_weights_gradient_all_reduce():
    with torch.device("meta"):
        model = Holder(Llama(LlamaConfig(**CONFIG)))
        model.model.lm_head.weight = model.model.embed_tokens.weight
    traffic = _traffic({"pp": 2, "dp_shard": 2}, {"pp_microbatches": 2}, model=model)
    assert traffic["pp"][0] == ACTIVATION + 4 * VOCAB * HIDDEN // 2  # this rank's fsdp shard of the embedding


def test_cp_sends_local_kv_around_the_ring_per_layer():
    """cp=2: one K/V hop forward, one again in backward, and two hops of their fp32 gradients (one on, one home)."""
    traffic = _traffic({"cp": 2, "dp_shard": 2}, {"zero_stage": 2})
    local_kv = 2 * (TOKENS // 2) * KV_DIM * 4
    assert traffic == {"fsdp": (2 * FULL_BYTES * 3 // 4, 4), "cp": (LAYERS * (2 * 1 + 2) * local_kv, 2)}


def test_ep_moves_token_copies_and_expert_dp_shards_the_experts():
    traffic = _traffic({"ep": 2, "dp_shard": 8}, {"zero_stage": 2}, devices=8, model=MOE)
    dense = 4 * (_numel(MOE) - _numel(MOE, *(f"layers.{i}.mlp.experts" for i in range(LAYERS))))
    experts_here = 4 * _numel(MOE, *(f"layers.{i}.mlp.experts" for i in range(LAYERS))) // 2
    assert traffic["fsdp"] == (2 * dense * 7 // 8, 8)
    assert traffic["ep"] == (LAYERS * 4 * TOKENS * 2 * HIDDEN * 4 // 2, 2)
    assert traffic["expert_dp"] == (2 * experts_here * 3 // 4, 4)


@pytest.mark.parametrize("pp", [1, 2])
def test_ep_calls_are_per_microbatch_with_the_counts_exchanged_and_summed_first(pp):
    """Each MoE block, per microbatch: 4 all-to-alls of the microbatch's token copies, one all-to-all and one
    all-reduce of the 8 experts' int64 counts (`expert_parallel/dispatch.py`)."""
    options = {"pp_microbatches": 4, "pp_schedule": "1f1b"} if pp > 1 else {}
    layout = dry_run(MOE, 8, {"ep": 2, "dp_shard": 8 // pp, "pp": pp}, options)
    calls = comm_per_step(layout, model_shape(MOE.model), WORKLOAD)["ep"].calls
    blocks, microbatches = LAYERS // pp, 4 if pp > 1 else 1
    rows = TOKENS * 2 * HIDDEN * 4 // microbatches
    assert [(c.kind, c.count, c.buffer_bytes) for c in calls] == [
        ("all_to_all", 4 * blocks * microbatches, rows), ("all_to_all", blocks * microbatches, 64),
        ("all_reduce", blocks * microbatches, 64)]


def test_a_single_rank_moves_nothing():
    assert _traffic({}, devices=1) == {}


def test_dense_blocks_of_an_moe_model_move_no_tokens_over_ep_or_etp():
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=24, v_head_dim=32)
    with torch.device("meta"):
        model = Holder(transformers.DeepseekV3ForCausalLM(config))
    assert model_shape(model.model).moe_blocks == (1, 2)
    routed = TOKENS * 2 * HIDDEN * 4  # top-2 copies of the batch's hidden states, fp32
    assert _traffic({"ep": 2, "dp_shard": 2}, devices=2, model=model)["ep"] == (2 * 4 * routed // 2, 2)
    tp = comm_per_step(dry_run(model, 2, {"tp": 2}, {}), model_shape(model.model), WORKLOAD)["tp"]
    assert "x4 (experts split over tp)" in tp.what, tp.what
