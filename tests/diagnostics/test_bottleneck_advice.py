"""The bottleneck advice (`diagnostics/analysis/bottleneck_advice.py`), through the classifier on hand-built
windows: one per class, each checked for the rank, dim or phase it names and the numbers its advice gives (the
bubble against its formula, tp across hosts, each role's communication, the loader's settings, host and compute
time); the advice leaving out what the run's options do already."""

from __future__ import annotations

from dataclasses import replace

import pytest

from diagnostics.analysis.bottleneck import Thresholds, classify
from diagnostics.records import Diagnosis
from tests.diagnostics.bottleneck_cases import balanced, context, eight_ranks_one_slow, times


def bubble(pp: int, microbatches: int, v: int = 1) -> float:
    """The theoretical bubble, written out here so the advice's numbers are checked against the formula itself."""
    return (pp - 1) / (v * microbatches + pp - 1)


def test_straggler_is_named_with_its_phase_and_the_others_wait():
    diagnosis = classify(eight_ranks_one_slow(), context({"dp_shard": 8}, roles={"fsdp": [list(range(8))]},
                                                         hosts={5: "node-b"}))
    assert (diagnosis.label, diagnosis.rank, diagnosis.phase, diagnosis.dim) == ("straggler", 5, "forward", None)
    assert "rank 5 is 1.6x slower in forward (0.32 s vs a median 0.20 s)" in diagnosis.advice[0]
    assert "wait 24% of the step" in diagnosis.advice[0] and "node-b" in diagnosis.advice[0]
    assert diagnosis.shares["waiting"] == pytest.approx(0.12 * 7 / 8 / 0.5)
    assert diagnosis.shares["comm:fsdp"] == pytest.approx(0.05 / 0.5)


def test_data_bound_with_the_loader_settings():
    diagnosis = classify(balanced(data_wait=0.2, forward=0.2, backward=0.12), context(num_workers=0))
    assert diagnosis.label == "data-bound"
    assert "data wait 38% of the step" in diagnosis.advice[0] and "num_workers (now 0)" in diagnosis.advice[0]
    assert "pin_memory" in diagnosis.advice[0] and "persistent_workers" in diagnosis.advice[0]
    assert "38%" in diagnosis.evidence and "0.20 s of 0.52 s" in diagnosis.evidence
    unknown = classify(balanced(data_wait=0.2, forward=0.2, backward=0.12), context())
    assert "None" not in unknown.advice[0] and "now" not in unknown.advice[0]


@pytest.mark.parametrize("pp, microbatches, schedule",
                         [(2, 2, "gpipe"), (4, 4, "1f1b"), (4, 2, "1f1b"), (2, 4, "1f1b"), (8, 1, "gpipe")])
def test_bubble_advice_names_the_microbatches_and_their_bubble(pp, microbatches, schedule):
    suggested = next((k * microbatches for k in (2, 4, 8, 16) if bubble(pp, k * microbatches) <= 0.12),
                     16 * microbatches)
    ranks = balanced(forward=0.2, backward=0.4, pipeline_idle=bubble(pp, microbatches) * 0.9)
    diagnosis = classify(ranks, context({"pp": pp}, pp_schedule=schedule, pp_microbatches=microbatches))
    assert diagnosis.label == "pipeline-bubble"
    share = round(100 * ranks[0].phases["pipeline_idle"] / ranks[0].step_s)
    assert f"bubble {share}% with {microbatches} microbatches at pp={pp} ({schedule})" in diagnosis.advice[0]
    assert f"pp_microbatches={suggested} gives ~{round(100 * bubble(pp, suggested))}%" in diagnosis.advice[0]
    assert f"~{round(100 * bubble(pp, microbatches, 2))}% at {microbatches} microbatches" in diagnosis.advice[1]
    assert "interleaved_1f1b" in diagnosis.advice[1]


def test_bubble_example_from_the_docs():
    diagnosis = classify(balanced(forward=0.2, backward=0.2, pipeline_idle=0.2),
                         context({"pp": 2}, pp_schedule="gpipe", pp_microbatches=2))
    assert diagnosis.advice[0].startswith("bubble 33% with 2 microbatches at pp=2 (gpipe): pp_microbatches=8"
                                          " gives ~11%")


def test_bubble_with_unknown_microbatches_gives_the_formula_and_no_interleave_when_interleaved():
    ranks = balanced(forward=0.2, backward=0.2, pipeline_idle=0.2)
    diagnosis = classify(ranks, context({"pp": 4}, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2))
    assert "unknown" in diagnosis.advice[0] and "(pp-1)/(v*m+pp-1)" in diagnosis.advice[0]
    needed = next(m for m in range(1, 100) if bubble(4, m, 2) <= 0.12)
    assert f"pp_microbatches={needed} gives ~{round(100 * bubble(4, needed, 2))}%" in diagnosis.advice[0]
    assert len(diagnosis.advice) == 1


def tp_bound(hosts: dict[int, str] | None = None) -> Diagnosis:
    ranks = [times(r, {"tp": 0.21}, forward=0.15, backward=0.13, host=0.02) for r in range(8)]
    return classify(ranks, context({"tp": 8}, roles={"tp": [list(range(8))]}, hosts=hosts or {}))


def test_tp_bound_within_a_node():
    diagnosis = tp_bound({r: "node-a" for r in range(8)})
    assert (diagnosis.label, diagnosis.dim, diagnosis.rank) == ("communication-bound", "tp", None)
    assert diagnosis.evidence == "tp communication takes 41% of the step (0.21 s of 0.51 s, mean over 8 ranks)"
    assert diagnosis.advice == ("tp=8 collectives take 41% of the step: try tp=4 with pp=2 (or dp_shard=2)",)


def test_tp_across_hosts_says_keep_it_in_a_node_first():
    diagnosis = tp_bound({r: "node-a" if r < 4 else "node-b" for r in range(8)})
    assert diagnosis.advice[0].startswith("tp spans hosts (ranks 0, 1, 2, 3, 4, 5, 6, 7 on node-a, node-b)")
    assert "keep tp inside a node (4 ranks per host)" in diagnosis.advice[0] and "tp=4" in diagnosis.advice[1]
    uneven = tp_bound({r: "node-a" if r < 6 else "node-b" for r in range(8)})
    assert "keep tp inside a node (2 to 6 ranks per host)" in uneven.advice[0]


@pytest.mark.parametrize("role, dims, words", [
    ("fsdp", {"dp_shard": 8}, ("dp_shard x cp = 8 ranks", "HSDP (dp_replicate=2, dp_shard=4)")),
    ("dp_replicate", {"dp_replicate": 4}, ("gradient all-reduce over dp_replicate=4", "accumulate_grad_batches")),
    ("cp", {"cp": 4}, ("cp=4 ring attention", "cp=2", "longer sequences")),
    ("ep", {"ep": 8}, ("ep=8 MoE all-to-all", "ep=4", "inside a node")),
    ("pp", {"pp": 4}, ("pp=4 point-to-point", "pp=2")),
    ("other", {}, ("other communication", "collective record")),
])
def test_communication_advice_per_role(role, dims, words):
    diagnosis = classify(balanced(comm={role: 0.2}, forward=0.2, backward=0.1), context(dims))
    assert (diagnosis.label, diagnosis.dim) == ("communication-bound", role)
    assert "40% of the step" in diagnosis.advice[0]
    for word in words:
        assert word in diagnosis.advice[0]


def test_host_bound():
    diagnosis = classify(balanced(host=0.35, forward=0.25, backward=0.4), context())
    assert diagnosis.label == "host-bound"
    assert "host time 35% of the step" in diagnosis.advice[0] and "NDParallel(compile=True)" in diagnosis.advice[0]
    assert classify(balanced(host=0.35, forward=0.25, backward=0.4), context(),
                    Thresholds(host_share=0.36)).label == "compute-bound"
    compiled = classify(balanced(host=0.35, forward=0.25, backward=0.4), context(options={"compile": "inductor"}))
    assert compiled.advice[0].startswith("host time 35% of the step (0.35 s outside every phase), the blocks compiled")
    assert "Python hooks" in compiled.advice[0] and not any("compile=True" in line for line in compiled.advice)


def test_compute_bound_with_mfu():
    diagnosis = classify(balanced(forward=0.3, backward=0.5, optimizer=0.1, host=0.1), context(mfu=0.38))
    assert diagnosis.label == "compute-bound" and diagnosis.shares["compute"] == pytest.approx(0.9)
    assert "compute-bound" in diagnosis.advice[0] and "MFU 38%" in diagnosis.advice[0]
    assert diagnosis.advice[1:] == ("bf16 mixed precision: Trainer(precision='bf16-mixed')",
                                    "torch.compile: NDParallel(compile=True)")
    assert compute_bound(precision="32-true").advice[1:] == diagnosis.advice[1:]


def test_compute_at_a_tiny_mfu_is_called_per_operation_overhead():
    diagnosis = classify(balanced(forward=0.3, backward=0.5, optimizer=0.1, host=0.1), context(mfu=0.0007))
    assert diagnosis.label == "compute-bound" and "MFU 0.07%" in diagnosis.advice[0]
    assert "per-operation overhead" in diagnosis.advice[0] and "larger batch per rank" in diagnosis.advice[0]


def compute_bound(**options) -> Diagnosis:
    return classify(balanced(forward=0.3, backward=0.5, optimizer=0.1, host=0.1), context(options=options))


@pytest.mark.parametrize("options, left_out", [
    ({"precision": "bf16-mixed"}, "bf16"), ({"precision": "16-mixed"}, "bf16"), ({"precision": 16}, "bf16"),
    ({"compile": True}, "compile"), ({"activation_checkpointing": "none"}, "recomputation")])
def test_compute_advice_leaves_out_what_the_run_does_already(options, left_out):
    assert not any(left_out in line for line in compute_bound(**options).advice)


@pytest.mark.parametrize("mode, lighter", [("full", "'selective' or 'none'"), ("selective", "'none'")])
def test_less_recomputation_only_under_checkpointing(mode, lighter):
    line = f"less activation recomputation if memory allows: activation_checkpointing={lighter} (now {mode!r})"
    assert line in compute_bound(activation_checkpointing=mode).advice
    assert not any("recomputation" in line for line in compute_bound(activation_checkpointing="none").advice)


def _quick_start_window() -> list:
    """The README's main job on a 2-core machine: 4 ranks, rank 0 waiting 1045 ms of a 2114 ms step."""
    return [times(r, {"tp": 0.30 if r == 0 else 0.05, "fsdp": 0.75 if r == 0 else 0.05}, forward=0.55, backward=0.45,
                  optimizer=0.05, host=0.01) for r in range(4)]


def test_four_processes_on_two_cores_are_a_shared_host_not_a_compute_bound_run():
    shared = context({"dp_shard": 2, "tp": 2}, hosts=dict.fromkeys(range(4), "laptop"), host_cores={"laptop": 2},
                     roles={"tp": [[0, 1], [2, 3]], "fsdp": [[0, 2], [1, 3]]}, options={"precision": "32-true"})
    diagnosis = classify(_quick_start_window(), shared)
    assert diagnosis.findings == ("host laptop runs 4 processes on 2 CPU cores: each gets 0.5 of a core, so compute"
                                  " is time-sliced and ranks wait for one another inside every collective",)
    assert diagnosis.advice[0].startswith("give each process its own core or GPU: fewer processes per host"
                                          " (trainer.devices, at most 2 here)")
    assert not any("bf16" in line.split(":")[0] or "Trainer(precision=" in line for line in diagnosis.advice)
    own = classify(_quick_start_window(), replace(shared, host_cores={"laptop": 8}))
    assert own.findings == () and not own.advice[0].startswith("give each process")
    gpus = classify(balanced(forward=0.5, backward=0.4), context(hosts=dict.fromkeys(range(4), "node"),
                                                                 shared_gpus={"GPU-1": (0, 1)}))
    assert gpus.findings == ("ranks 0, 1 share one GPU (GPU-1): their kernels queue on it",)


def test_the_shared_host_is_on_the_card_and_the_console_line():
    from diagnostics.records import WindowRecord
    from diagnostics.report.bottleneck_card import bottleneck_markdown, bottleneck_summary

    shared = context(hosts=dict.fromkeys(range(4), "laptop"), host_cores={"laptop": 2})
    record = WindowRecord(shared, tuple(balanced(forward=0.5, backward=0.4)), classify(balanced(forward=0.5,
                                                                                                backward=0.4), shared))
    assert "**Shared host:** host laptop runs 4 processes on 2 CPU cores" in bottleneck_markdown(record, True)
    assert "; shared host: host laptop runs 4 processes" in bottleneck_summary(record)


def test_a_window_without_a_profiled_step_is_not_called_compute_bound():
    """Rank 2 is slow, but without a profiled step its peers' wait for it sits inside their forward too: every rank
    looks alike, and the window is said to be undecided, with what to change, instead of compute-bound."""
    hidden = balanced(forward=0.6, backward=0.3, optimizer=0.05)
    unsplit = classify(hidden, context({"dp_shard": 2, "tp": 2}, profiled=False))
    assert unsplit.label == "not-enough-evidence" and unsplit.rank is None
    assert "no step of this window (0-10, 10 steps measured over 4 ranks) was profiled" in unsplit.evidence
    assert "BottleneckMonitor(every_n_steps=N, profile=True)" in unsplit.advice[0]
    assert classify(hidden, context(profiled=True)).label == "compute-bound"  # profiled, no communication: compute
    assert classify(hidden, context()).label == "compute-bound"  # a record that does not say (older files)
    assert classify(hidden[:1], context(profiled=False)).label == "compute-bound"  # one rank waits for nobody


def test_each_ranks_host_cores_and_gpu_become_the_hosts_cores_and_shared_gpus():
    from diagnostics.collect.host import host_shares

    places = [("a", frozenset({0}), None), ("a", frozenset({1}), None), ("b", frozenset({0, 1}), "GPU-7"),
              ("b", frozenset({0, 1}), "GPU-7"), ("b", frozenset({0, 1}), "GPU-8")]
    assert host_shares(places) == ({0: "a", 1: "a", 2: "b", 3: "b", 4: "b"}, {"a": 2, "b": 2}, {"GPU-7": (2, 3)})
