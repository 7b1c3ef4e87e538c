"""`Hardware` presets and parsers, and `step_time`: PaLM FLOPs, links by node, the overlap rule and the bubble."""

from __future__ import annotations

import pytest
import torch

from examples.models.llama import Llama, LlamaConfig
from lightning_nd.cost.comm import comm_per_step
from lightning_nd.cost.hardware import PRESETS, Hardware, parse_bytes, parse_hardware
from lightning_nd.cost.shape import Workload, model_shape
from lightning_nd.cost.step_time import step_time
from lightning_nd.planner.dry_run import dry_run
from lightning_nd.planner.source import Holder

CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=8)
SEQ, BATCH = 32, 2
WORKLOAD = Workload(seq_len=SEQ, batch=BATCH)
ROUND = Hardware("round", peak_flops=1e12, memory_bytes=10**10, intra_node_bytes_per_s=1e11,
                 inter_node_bytes_per_s=1e10)

with torch.device("meta"):
    MODEL = Holder(Llama(LlamaConfig(**CONFIG)))
SHAPE = model_shape(MODEL.model)
FLOPS_PER_TOKEN = 6 * sum(p.numel() for p in MODEL.parameters()) + 12 * 4 * 256 * SEQ  # PaLM: 6N + 12 L h s


@pytest.mark.parametrize(("text", "expected"), [
    ("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("512MB", 512 * 10**6), ("512MiB", 512 * 2**20),
    ("80", 80 * 10**9), ("1.5TB", 1500 * 10**9), ("141 gb", 141 * 10**9),
])
def test_parse_bytes_reads_decimal_and_binary_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["eighty", "80GBs", "80 Gb/s", "-1GB", "0", ""])
def test_parse_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(ValueError, match="HINT: write e.g. `80GB`"):
        parse_bytes(text)


def test_presets_carry_the_datasheet_figures():
    h100, h200, a100 = PRESETS["h100"], PRESETS["h200"], PRESETS["a100"]
    assert (h100.peak_flops, h100.memory_bytes, h100.intra_node_bytes_per_s, h100.inter_node_bytes_per_s) == (
        989e12, 80 * 10**9, 450e9, 50e9)
    assert h200.memory_bytes == 141 * 10**9 and (h200.peak_flops, h200.intra_node_bytes_per_s) == (989e12, 450e9)
    assert (a100.peak_flops, a100.intra_node_bytes_per_s, a100.inter_node_bytes_per_s) == (312e12, 300e9, 25e9)
    assert PRESETS["b200"].peak_flops > h100.peak_flops and PRESETS["cpu"].peak_flops < 1e12
    assert all(name == preset.name for name, preset in PRESETS.items())


def test_parse_hardware_takes_a_preset_with_overrides():
    assert parse_hardware("h100") == PRESETS["h100"] and parse_hardware("H200") == PRESETS["h200"]
    custom = parse_hardware("h100, peak_flops=7e14,inter_node_bytes_per_s=25e9,memory_bytes=96GB")
    assert (custom.peak_flops, custom.inter_node_bytes_per_s, custom.memory_bytes) == (7e14, 25e9, 96 * 10**9)
    assert custom.intra_node_bytes_per_s == 450e9
    assert parse_hardware("a100,memory_bytes=4e10").memory_bytes == 40 * 10**9  # a bare number: the field's unit


@pytest.mark.parametrize(("text", "hint"), [
    ("h10", "did you mean `h100`?"), ("h100,peak_flop=1e15", "did you mean `peak_flops`?"),
    ("h100,name=x", "Fields: peak_flops, memory_bytes"), ("h100,peak_flops=fast", "HINT: e.g. `peak_flops=5e10`"),
    ("h100,inter_node_bytes_per_s=-1", "must be positive"), ("h100,memory_bytes=lots", "HINT: write e.g. `80GB`"),
])
def test_parse_hardware_names_the_fix(text, hint):
    with pytest.raises(ValueError, match="HINT") as error:
        parse_hardware(text)
    assert hint in str(error.value)


def _layout(devices: int, sizes: dict, options: dict | None = None):
    return dry_run(MODEL, devices, sizes, options or {})


def test_tp_inside_a_node_rides_nvlink_and_fsdp_across_nodes_the_network():
    layout = _layout(64, {"tp": 8, "dp_shard": 8}, {"zero_stage": 2})
    time = step_time(layout, SHAPE, WORKLOAD, ROUND, gpus_per_node=8)
    traffic = comm_per_step(layout, SHAPE, WORKLOAD)
    assert time.link == {"tp": "nvlink", "fsdp": "network"}
    assert time.comm_s == {"tp": traffic["tp"].bytes / 1e11, "fsdp": traffic["fsdp"].bytes / 1e10}
    assert step_time(layout, SHAPE, WORKLOAD, ROUND, gpus_per_node=64).link == {"tp": "nvlink", "fsdp": "nvlink"}
    assert step_time(layout, SHAPE, WORKLOAD, ROUND, gpus_per_node=4).link == {"tp": "network", "fsdp": "network"}


def test_compute_is_palm_flops_shared_by_tp_cp_pp_at_peak():
    layout = _layout(8, {"tp": 2, "cp": 2, "dp_shard": 2})
    twice = Workload(seq_len=SEQ, batch=BATCH, accumulation=2)
    time = step_time(layout, SHAPE, twice, ROUND, gpus_per_node=8)
    assert time.flops_per_step == FLOPS_PER_TOKEN * BATCH * SEQ * 2 / 4
    assert time.compute_s == pytest.approx(time.flops_per_step / 1e12)


@pytest.mark.parametrize(("mode", "factor"), [("none", 1), ("selective", 1), ("full", 4 / 3)])
def test_full_checkpointing_redoes_the_forward(mode, factor):
    layout = _layout(2, {"dp_shard": 2}, {"activation_checkpointing": mode})
    time = step_time(layout, SHAPE, WORKLOAD, ROUND, gpus_per_node=8)
    assert time.flops_per_step == pytest.approx(FLOPS_PER_TOKEN * BATCH * SEQ * factor)


def test_only_the_excess_of_fsdp_over_compute_is_exposed_and_tp_always():
    layout = _layout(64, {"tp": 8, "dp_shard": 8}, {"zero_stage": 2})
    fast = step_time(layout, SHAPE, WORKLOAD, ROUND, gpus_per_node=64)
    assert fast.comm_s["fsdp"] < fast.compute_s
    assert fast.exposed_comm_s == pytest.approx(fast.comm_s["tp"])
    slow = step_time(layout, SHAPE, WORKLOAD, ROUND, gpus_per_node=8)
    assert slow.comm_s["fsdp"] > slow.compute_s
    assert slow.exposed_comm_s == pytest.approx(slow.comm_s["tp"] + slow.comm_s["fsdp"] - slow.compute_s)
    assert slow.total_s == pytest.approx(slow.compute_s + slow.exposed_comm_s) and slow.bubble_fraction == 0


@pytest.mark.parametrize(("schedule", "bubble"), [
    ("gpipe", 1 / 5), ("1f1b", 1 / 5), ("interleaved_1f1b", 1 / 9), ("looped_bfs", 1 / 9),
    ("zbv", 1 / 9),  # the interleaved formula: an upper bound for the zero-bubble schedules
])
def test_bubble_follows_the_schedule(schedule, bubble):
    layout = _layout(4, {"pp": 2, "dp_shard": 2}, {"pp_schedule": schedule, "pp_microbatches": 4})
    time = step_time(layout, SHAPE, WORKLOAD, ROUND, gpus_per_node=8)
    assert time.bubble_fraction == pytest.approx(bubble)
    assert time.total_s == pytest.approx((time.compute_s + time.exposed_comm_s) / (1 - bubble))
    assert time.flops_per_step == pytest.approx(FLOPS_PER_TOKEN * BATCH * SEQ / 2)


def test_gpus_per_node_must_be_positive():
    with pytest.raises(ValueError, match="HINT: e.g. 8"):
        step_time(_layout(2, {"dp_shard": 2}), SHAPE, WORKLOAD, ROUND, gpus_per_node=0)
