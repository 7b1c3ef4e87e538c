"""The cost model's memory: the literature's figures, the activations our blocks really save, the model state
a Layout implies, and one process's measured peak (torch's `MemTracker`) for each recomputation mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from examples.models.gpt import GPT, Block, GPTConfig
from examples.models.llama import DecoderLayer, Llama, LlamaConfig
from lightning_nd.cost.activations import block_bytes, korthikanti_layer_bytes
from lightning_nd.cost.memory import rank_memory
from lightning_nd.cost.model_state import model_state, zero_paper_bytes
from lightning_nd.cost.shape import Workload, model_shape
from lightning_nd.parallel.activation import apply_ac
from lightning_nd.planner.dry_run import dry_run

LLAMA = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=2)
MOE = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
MOE_SQUARE = LlamaConfig(**{**vars(MOE), "intermediate_size": 128})  # experts as wide as the hidden size (conf/model/moe.yaml)
GPT_CONFIG = GPTConfig(vocab_size=256, n_embd=96, n_head=4, n_layer=2, block_size=64)


def test_zero_paper_table_1():
    """Rajbhandari et al. 2020, Table 1: 7.5B parameters, 64 devices, K = 12."""
    gigabytes = {stage: round(value / 1e9, 2) for stage, value in zero_paper_bytes(7.5e9, 64).items()}
    assert gigabytes == {"DP": 120.0, "P_os": 31.41, "P_os+g": 16.64, "P_os+g+p": 1.88}


def test_korthikanti_closed_forms():
    """Equations 1-4 of Korthikanti et al. 2022, at GPT-3 175B's sizes (s=2048, h=12288, a=96, t=8, b=1)."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert korthikanti_layer_bytes(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert korthikanti_layer_bytes(s, b, h, a, t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert korthikanti_layer_bytes(s, b, h, a, t, sequence_parallel=True) == sbh * (34 / t + 5 * a * s / (h * t))
    assert korthikanti_layer_bytes(s, b, h, a, t, sequence_parallel=True, recompute="selective") == 34 * sbh / t
    assert korthikanti_layer_bytes(s, b, h, a, t, sequence_parallel=True, recompute="full") == 2 * sbh / t
    # The paper's point: selective recomputation with sequence parallelism needs 5x less than tensor parallelism alone.
    ratio = korthikanti_layer_bytes(s, b, h, a, t) / korthikanti_layer_bytes(s, b, h, a, t, sequence_parallel=True,
                                                                            recompute="selective")
    assert 4.9 < ratio < 5.5


def _forward_activations(block: torch.nn.Module, x: torch.Tensor, *args) -> int:
    """Bytes torch keeps alive after ``block``'s forward, less its output: what backward will read."""
    with MemTracker() as tracker:
        tracker.track_external(block)
        out = block(x, *args)
        (snapshot,) = tracker.get_tracker_snapshot().values()
    return snapshot["Activation"] - out.numel() * out.element_size()


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("family", ["llama", "gpt", "moe", "moe_square"])
def test_block_activations_are_what_the_block_saves(family, mode):
    """The per-block count of `cost.activations` against what torch really keeps, for both block kinds (and experts
    as wide as the hidden size, whose inner size the shape reads from the stacks as I, not as the dense 4h)."""
    torch.manual_seed(0)
    batch, seq = 2, 64
    if family in ("llama", "moe", "moe_square"):
        config = {"llama": LLAMA, "moe": MOE, "moe_square": MOE_SQUARE}[family]
        block, shape, extra = DecoderLayer(config), model_shape(Llama(config)), (torch.arange(seq),)
        assert shape.intermediate == config.intermediate_size
    else:
        block, shape, extra = Block(GPT_CONFIG), model_shape(GPT(GPT_CONFIG)), ()
    apply_ac([block], mode)
    x = torch.randn(batch, seq, shape.hidden, requires_grad=True)
    measured = _forward_activations(block, x, *extra)
    expected = block_bytes(shape, batch * seq, 4, recompute=mode)
    assert measured == pytest.approx(expected, rel=0.03), (measured, expected)


def test_a_dense_block_of_an_moe_model_is_priced_as_dense():
    """DeepSeek's shape: a dense first block (its own inner size) before MoE blocks; each kind's count against what
    torch keeps, and the model's shape reads both inner sizes."""
    torch.manual_seed(0)
    dense_config = LlamaConfig(**{**vars(MOE), "num_experts": 0, "intermediate_size": 352, "num_hidden_layers": 3})
    model = Llama(LlamaConfig(**{**vars(MOE), "num_hidden_layers": 3}))
    model.layers[0] = DecoderLayer(dense_config)
    shape = model_shape(model)
    assert (shape.moe_blocks, shape.intermediate, shape.dense_intermediate) == ((1, 2), 96, 352)
    batch, seq = 2, 64
    for index, moe in ((0, False), (1, True)):
        x = torch.randn(batch, seq, shape.hidden, requires_grad=True)
        measured = _forward_activations(model.layers[index], x, torch.arange(seq))
        expected = block_bytes(shape, batch * seq, 4, moe=moe)
        assert measured == pytest.approx(expected, rel=0.03), (index, measured, expected)


def test_model_state_is_the_layout_shards_priced():
    with torch.device("meta"):
        model = Llama(LLAMA)
    layout = dry_run(model, 4, {"tp": 2, "dp_shard": 2}, {})
    for rank in range(4):
        state, holding = model_state(layout, rank), layout.rank(rank)
        assert state.params_bytes == state.grads_bytes == holding.param_bytes
        assert state.optimizer_bytes == 2 * holding.param_bytes + 4 * len(holding.params)
    with pytest.raises(ValueError, match="HINT: use one of adamw"):
        model_state(layout, 0, "adamm")


def _measured_peak(model: torch.nn.Module, tokens: torch.Tensor, steps: int = 2) -> int:
    """One process, Lightning's order (forward, zero_grad, backward, step): MemTracker's peak of the last step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in range(steps - 1):
        step()
    with MemTracker() as tracker:
        tracker.track_external(model, optimizer)
        step()
        (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    return snapshot["Total"]


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_one_process_peak_within_ten_percent(mode):
    torch.manual_seed(0)
    model = Llama(LLAMA)
    apply_ac(list(model.layers), mode)
    batch, seq = 4, 128
    measured = _measured_peak(model, torch.randint(0, LLAMA.vocab_size, (batch, seq + 1)))
    with torch.device("meta"):
        layout = dry_run(Llama(LLAMA), 1, {}, {"activation_checkpointing": mode})
    expected = rank_memory(layout, model_shape(model), Workload(seq_len=seq, batch=batch), 0)
    assert expected.peak_bytes == pytest.approx(measured, rel=0.10), (expected, measured)


def test_cpu_offload_keeps_the_sharded_state_off_the_device():
    with torch.device("meta"):
        model = Llama(LLAMA)
    on_device = dry_run(model, 4, {"dp_shard": 4}, {})
    offloaded = dry_run(model, 4, {"dp_shard": 4}, {"cpu_offload": True})
    workload = Workload(seq_len=128, batch=4)
    kept, moved = (rank_memory(layout, model_shape(model), workload, 0) for layout in (on_device, offloaded))
    assert (moved.params_bytes, moved.optimizer_bytes) == (kept.params_bytes, kept.optimizer_bytes)
    assert moved.peak_bytes <= kept.peak_bytes - kept.params_bytes - kept.optimizer_bytes
