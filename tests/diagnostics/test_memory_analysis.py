"""The out-of-memory analyses on recorded inputs: torch's real OOM messages (`tests/data/oom/`, sources in its
SOURCES.md), the breakdown, the ranking of fixes, the verdict line, the card, and the JSON the probe writes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from diagnostics.analysis.memory import breakdown, human_bytes, largest_gap, largest_part, rank_advice, verdict
from diagnostics.analysis.oom import parse_oom
from diagnostics.records import KINDS, MemoryReport, from_dict, to_dict, to_json
from diagnostics.report.memory_card import UNKNOWN_ON_CPU, memory_card, memory_summary

SAMPLES = Path(__file__).resolve().parents[1] / "data" / "oom"
KiB, MiB, GiB = 1024, 1024**2, 1024**3


def size(number: float, unit: int) -> int:
    return round(number * unit)


EXPECTED = {
    "cuda_this_process.txt": dict(
        device="cuda:0", requested_bytes=size(22.00, MiB), capacity_bytes=size(23.65, GiB),
        free_bytes=size(11.06, MiB), process_in_use_bytes=size(23.60, GiB), allocated_bytes=size(22.90, GiB),
        reserved_unallocated_bytes=size(194.87, MiB), allowed_bytes=None, other_processes=()),
    "cuda_other_process.txt": dict(
        device="cuda:1", requested_bytes=size(1.25, GiB), capacity_bytes=size(93.02, GiB),
        free_bytes=size(1.18, GiB), process_in_use_bytes=None, allocated_bytes=size(90.63, GiB),
        reserved_unallocated_bytes=size(120.54, MiB), other_processes=((2752205, size(91.82, GiB)),)),
    "cuda_2_1_two_processes.txt": dict(
        device="cuda:0", requested_bytes=size(138.00, MiB), capacity_bytes=size(15.90, GiB),
        free_bytes=size(8.44, MiB), process_in_use_bytes=size(15.32, GiB), allocated_bytes=size(14.12, GiB),
        reserved_unallocated_bytes=size(410.41, MiB), other_processes=((1246069, size(577.00, MiB)),)),
    "cuda_2_1_no_nvml.txt": dict(
        device="cuda:0", requested_bytes=size(1.70, GiB), capacity_bytes=size(6.00, GiB), free_bytes=0,
        process_in_use_bytes=None, allocated_bytes=size(2.93, GiB), reserved_unallocated_bytes=size(2.30, GiB)),
    "hip_allowed_private_pools.txt": dict(
        device="cuda:0", requested_bytes=size(2.00, MiB), capacity_bytes=size(287.98, GiB),
        free_bytes=size(275.86, GiB), allowed_bytes=size(1.05, GiB), allocated_bytes=size(1017.01, MiB),
        reserved_unallocated_bytes=size(54.99, MiB)),
    "hip_traceback.txt": dict(
        device="cuda:0", requested_bytes=size(3.31, GiB), capacity_bytes=size(128.00, GiB),
        free_bytes=size(780.24, MiB), allocated_bytes=size(57.70, GiB), reserved_unallocated_bytes=size(75.82, MiB)),
    "cuda_1x_reserved.txt": dict(
        device="cuda:1", requested_bytes=size(1.65, GiB), capacity_bytes=size(7.79, GiB),
        free_bytes=size(1.40, GiB), process_in_use_bytes=None, allocated_bytes=size(3.53, GiB),
        reserved_unallocated_bytes=size(5.28, GiB) - size(3.53, GiB)),
    "cuda_before_2_1_zero_free.txt": dict(
        device="cuda:0", requested_bytes=size(10.73, GiB), capacity_bytes=size(8.00, GiB), free_bytes=0,
        allocated_bytes=size(17.20, GiB), reserved_unallocated_bytes=size(19.15, GiB) - size(17.20, GiB)),
    "cuda_1_0_cached.txt": dict(
        device="cuda:0", requested_bytes=size(12.50, MiB), capacity_bytes=size(10.92, GiB),
        free_bytes=size(9.28, GiB), allocated_bytes=size(8.57, MiB), reserved_unallocated_bytes=size(4.68, MiB)),
    "cpu_posix.txt": dict(device="cpu", requested_bytes=1125899906842624, capacity_bytes=None, free_bytes=None,
                          allocated_bytes=None),
    "cpu_windows.txt": dict(device="cpu", requested_bytes=1981808640, capacity_bytes=None),
}


def test_every_sample_has_expectations_and_a_source():
    files = {path.name for path in SAMPLES.glob("*.txt")}
    assert files == set(EXPECTED)
    sources = (SAMPLES / "SOURCES.md").read_text()
    assert all(f"`{name}`" in sources for name in files)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_parse_oom_reads_every_number_torch_printed(name):
    text = (SAMPLES / name).read_text()
    message = parse_oom(text)
    for field, value in EXPECTED[name].items():
        assert getattr(message, field) == value, field
    assert len(message.text) <= 500
    assert message.text in text and ("out of memory" in message.text or "DefaultCPUAllocator" in message.text)


def test_parse_oom_keeps_only_the_text_of_anything_else():
    message = parse_oom("\nRuntimeError: CUDA error: an illegal memory access was encountered\nmore")
    assert message.text == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert message.device == "" and message.requested_bytes is None and message.capacity_bytes is None
    assert parse_oom("").text == ""


def test_parse_oom_reads_past_the_500_characters_it_keeps():
    """A logger's prefix (a worker name, a test id) can push the sizes past what ``text`` keeps."""
    line = "[worker] " * 40 + (SAMPLES / "hip_allowed_private_pools.txt").read_text()
    message = parse_oom(line)
    assert "reserved by PyTorch but unallocated" not in message.text and len(message.text) == 500
    assert message.reserved_unallocated_bytes == size(54.99, MiB)


def test_human_bytes_is_1024_based():
    assert [human_bytes(n) for n in (512, 2 * GiB, 1536 * KiB, 3 * 1024 * GiB)] == \
        ["512 B", "2.0 GiB", "1.5 MiB", "3.0 TiB"]


def test_breakdown_orders_kinds_and_sums_the_total_only_when_every_part_is_known():
    parts = {"params": 4, "grads": 4, "optimizer": 8, "activations": 20, "temporaries": 2, "non_pytorch": 1}
    figures = breakdown(parts, {"params": 4, "activations": 10}, {"params": "local shards"})
    assert tuple(f.kind for f in figures) == KINDS
    assert figures[0].source == "local shards" and figures[3].expected_bytes == 10
    assert (figures[-1].measured_bytes, figures[-1].source) == (39, "sum of the parts")
    assert figures[-1].expected_bytes is None

    cpu = breakdown({**parts, "activations": None}, {}, {"activations": "unknown on CPU"})
    assert cpu[-1].measured_bytes is None and cpu[3].source == "unknown on CPU"
    direct = breakdown({**parts, "activations": None, "total": 50}, {"total": 45}, {"total": "process RSS"})
    assert (direct[-1].measured_bytes, direct[-1].expected_bytes, direct[-1].source) == (50, 45, "process RSS")


def test_rank_advice_keeps_savings_only_largest_first_ties_by_action():
    candidates = [("tp=2", {"tp": 2}, 70, "split every matrix"),
                  ("activation_checkpointing='full'", {"activation_checkpointing": "full"}, 40, "recompute"),
                  ("dp_shard=8", {"dp_shard": 8}, 70, "shard more"),
                  ("micro_batch_size=2", {"micro_batch_size": 2}, 100, "no change"),
                  ("fp32", {"mixed_precision": None}, 120, "costs more")]
    advice = rank_advice(100, candidates)
    assert [a.action for a in advice] == ["activation_checkpointing='full'", "dp_shard=8", "tp=2"]
    assert [(a.saving_bytes, a.peak_after_bytes) for a in advice] == [(60, 40), (30, 70), (30, 70)]
    assert advice[0].change == {"activation_checkpointing": "full"}


def report(device: str = "cuda:0", measured_activations: int | None = 61 * GiB) -> MemoryReport:
    oom = parse_oom((SAMPLES / "cuda_this_process.txt").read_text())
    figures = breakdown(
        {"params": 2 * GiB, "grads": 2 * GiB, "optimizer": 4 * GiB, "activations": measured_activations,
         "temporaries": GiB, "non_pytorch": GiB // 2},
        {"params": 2 * GiB, "grads": 2 * GiB, "optimizer": 4 * GiB, "activations": 20 * GiB, "total": 30 * GiB},
        {"params": "local shards", "activations": "CUDA allocator" if measured_activations else "unknown on CPU"})
    advice = rank_advice(70 * GiB, [("tp=2", {"tp": 2}, 50 * GiB, "halves | every matrix"),
                                    ("activation_checkpointing='full'", {"activation_checkpointing": "full"},
                                     29 * GiB, "recomputes the forward")])
    return MemoryReport(rank=1, step=4, culprit=3, device=device, capacity_bytes=40 * GiB, oom=oom, figures=figures,
                        advice=advice, dims={"dp_shard": 2, "tp": 1}, options={"activation_checkpointing": None},
                        notes=("activations measured as allocated minus model state",))


def test_largest_gap_names_what_the_estimate_missed():
    figures = report().figures
    assert largest_gap(figures).kind == "activations"
    assert largest_part(figures).kind == "activations"
    assert largest_gap(report(measured_activations=None).figures) is None
    assert largest_part(report(measured_activations=None).figures).measured_bytes is None


def test_verdict_names_rank_step_request_kind_and_fix():
    line = verdict(report())
    assert line == ("rank 3 ran out of memory at step 4 asking for 22.0 MiB: activations 61.0 GiB of 40.0 GiB,"
                    " 41.0 GiB more than the 20.0 GiB expected; best fix: activation_checkpointing='full'"
                    " saves 41.0 GiB")
    cpu = verdict(report(device="cpu", measured_activations=None))
    assert "activations 20.0 GiB (estimated) of 40.0 GiB" in cpu
    bare = MemoryReport(0, None, None, "cpu", None, None, (), (), {}, {})
    assert verdict(bare) == ("rank 0 ran out of memory: no part of the memory could be measured or estimated;"
                             " no candidate fix lowers the peak")


def test_card_renders_every_figure_the_message_and_the_advice_in_order():
    card = memory_card(report())
    for kind in KINDS:
        assert any(line.startswith(f"| {kind} |") or line.startswith(f"| **{kind}** |") for line in card.splitlines())
    assert card.startswith("**Out of memory: rank 3 ran out of memory at step 4")
    assert "| activations | 61.0 GiB | 20.0 GiB | CUDA allocator |" in card
    assert "requested 22.0 MiB, capacity 23.7 GiB, free 11.1 MiB, in use by this process 23.6 GiB" in card
    first = card.index("| 1 | `activation_checkpointing='full'` | 41.0 GiB | 29.0 GiB (fits) | recomputes")
    second = card.index("| 2 | `tp=2` | 20.0 GiB | 50.0 GiB (still over) | halves \\| every matrix |")
    assert first < second
    assert "- activations measured as allocated minus model state" in card
    cpu_card = memory_card(report(device="cpu", measured_activations=None))
    assert f"| activations | {UNKNOWN_ON_CPU} | 20.0 GiB | unknown on CPU |" in cpu_card


def test_summary_is_the_verdict_and_the_top_three():
    lines = memory_summary(report()).splitlines()
    assert lines[1].strip() == verdict(report())
    assert lines[2:] == ["  1. activation_checkpointing='full': saves 41.0 GiB, peak 29.0 GiB",
                         "  2. tp=2: saves 20.0 GiB, peak 50.0 GiB"]


def test_report_round_trips_through_json():
    original = report()
    again = from_dict(MemoryReport, json.loads(to_json(original)))
    assert again == original
    assert to_dict(again) == to_dict(original)
    two_processes = replace(original, oom=parse_oom((SAMPLES / "cuda_2_1_two_processes.txt").read_text()))
    assert from_dict(MemoryReport, json.loads(to_json(two_processes))) == two_processes
    bare = MemoryReport(0, None, None, "cpu", None, None, (), (), {}, {})
    assert from_dict(MemoryReport, json.loads(to_json(bare))) == bare
