"""The bottleneck classifier (`diagnostics/analysis/bottleneck.py`) and its advice (`bottleneck_advice.py`) on
hand-built windows: one per class, each checked for the rank, dim or phase it names and the numbers its advice
gives; stragglers sought within a pp stage; the advice leaving out what the run's options do already; the waiting
moved out of the collectives group by group; the residual kept apart; the thresholds at their edges."""

from __future__ import annotations

import functools
import typing
from collections.abc import Sequence

import pytest

from diagnostics.analysis.bottleneck import Classifier, Thresholds, attribute_waiting, classify, waiting_by_role
from diagnostics.bottleneck_records import LABELS, PHASES, Diagnosis, RankTimes, WindowContext

DIMS = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1}


def times(rank: int, comm: dict[str, float] | None = None, residual: float = 0.0, step: float | None = None,
          **phases: float) -> RankTimes:
    """A rank's step; ``step`` defaults to what its parts add up to."""
    comm = dict(comm or {})
    full = {phase: 0.0 for phase in PHASES} | phases
    total = sum(full.values()) + sum(comm.values()) + residual
    return RankTimes(rank, 10, total if step is None else step, full, comm, residual)


def context(dims: dict[str, int] | None = None, **fields) -> WindowContext:
    return WindowContext(first_step=0, last_step=10, dims=DIMS | (dims or {}), **fields)


def bubble(pp: int, microbatches: int, v: int = 1) -> float:
    """The theoretical bubble, written out here so the advice's numbers are checked against the formula itself."""
    return (pp - 1) / (v * microbatches + pp - 1)


def test_waiting_moves_the_excess_over_the_fastest_member_and_keeps_the_sum():
    ranks = [times(0, {"tp": 0.10}, forward=0.2, waiting=0.01), times(1, {"tp": 0.14}, forward=0.2)]
    moved = attribute_waiting(ranks, {"tp": [[0, 1]]})
    assert moved[0].comm["tp"] == 0.10 and moved[0].phases["waiting"] == 0.01
    assert moved[1].comm["tp"] == pytest.approx(0.10) and moved[1].phases["waiting"] == pytest.approx(0.04)
    for before, after in zip(ranks, moved):
        assert sum(after.phases.values()) + sum(after.comm.values()) == pytest.approx(
            sum(before.phases.values()) + sum(before.comm.values()))
        assert (after.step_s, after.residual_s, after.rank) == (before.step_s, before.residual_s, before.rank)
    assert ranks[1].comm["tp"] == 0.14 and ranks[1].phases["waiting"] == 0.0


def test_waiting_stays_inside_each_group():
    ranks = [times(0, {"tp": 0.10}), times(1, {"tp": 0.14}), times(2, {"tp": 0.30}), times(3, {"tp": 0.31})]
    moved = attribute_waiting(ranks, {"tp": [[0, 1], [2, 3]]})
    assert [t.comm["tp"] for t in moved] == pytest.approx([0.10, 0.10, 0.30, 0.30])
    assert [t.phases["waiting"] for t in moved] == pytest.approx([0.0, 0.04, 0.0, 0.01])


def test_a_role_without_groups_spans_every_rank_and_absent_members_are_skipped():
    ranks = [times(0, {"other": 0.02, "tp": 0.3}), times(1, {"other": 0.05}), times(2, {"other": 0.03})]
    waits = waiting_by_role(ranks, {"tp": [[0, 7]]})
    assert waits[0] == pytest.approx({"other": 0.0, "tp": 0.0})
    assert waits[1] == pytest.approx({"other": 0.03}) and waits[2] == pytest.approx({"other": 0.01})


def eight_ranks_one_slow(slow_forward: float = 0.32) -> list[RankTimes]:
    """Rank 5 is slow in forward; the others wait for it inside FSDP's collectives."""
    extra = slow_forward - 0.20
    return [times(r, {"fsdp": 0.05 + (0.0 if r == 5 else extra)}, forward=slow_forward if r == 5 else 0.20,
                  backward=0.10, optimizer=0.02, host=0.01) for r in range(8)]


def test_straggler_is_named_with_its_phase_and_the_others_wait():
    diagnosis = classify(eight_ranks_one_slow(), context({"dp_shard": 8}, roles={"fsdp": [list(range(8))]},
                                                         hosts={5: "node-b"}))
    assert (diagnosis.label, diagnosis.rank, diagnosis.phase, diagnosis.dim) == ("straggler", 5, "forward", None)
    assert "rank 5 is 1.6x slower in forward (0.32 s vs a median 0.20 s)" in diagnosis.advice[0]
    assert "wait 24% of the step" in diagnosis.advice[0] and "node-b" in diagnosis.advice[0]
    assert diagnosis.shares["waiting"] == pytest.approx(0.12 * 7 / 8 / 0.5)
    assert diagnosis.shares["comm:fsdp"] == pytest.approx(0.05 / 0.5)


def test_straggler_comes_before_the_communication_it_causes():
    ranks = eight_ranks_one_slow()
    roles = {"fsdp": [list(range(8))]}
    relaxed = Thresholds(straggler_share=0.5)
    assert classify(ranks, context(roles=roles), relaxed).label == "communication-bound"
    assert classify(ranks, context(roles=roles)).label == "straggler"


def test_two_rank_straggler_against_the_mean_of_both():
    ranks = [times(0, {"world": 0.15}, forward=0.1, backward=0.1), times(1, {"world": 0.05}, forward=0.2, backward=0.1)]
    diagnosis = classify(ranks, context())
    assert (diagnosis.label, diagnosis.rank, diagnosis.phase) == ("straggler", 1, "forward")
    assert "1.3x slower in forward (0.20 s vs a median 0.15 s)" in diagnosis.advice[0]
    assert classify(ranks, context(), Thresholds(straggler_ratio=1.34)).label != "straggler"


def test_slow_loader_on_one_rank():
    ranks = [times(r, {"world": 0.2 if r else 0.05}, data_wait=0.2 if r == 0 else 0.05, forward=0.2)
             for r in range(4)]
    diagnosis = classify(ranks, context())
    assert (diagnosis.label, diagnosis.rank, diagnosis.phase) == ("straggler", 0, "data_wait")
    assert "loader" in diagnosis.advice[0]


def two_stages(forward: dict[int, float], backward: dict[int, float]) -> list[RankTimes]:
    """pp=2 x dp=2, pp groups [0, 1] and [2, 3]: ranks 0 and 2 run stage 0, ranks 1 and 3 stage 1 (the head and
    the loss). Stage 0 idles while stage 1 finishes, so every step is 0.8 s."""
    return [times(r, forward=forward[r], backward=backward[r], step=0.8,
                  pipeline_idle=0.8 - forward[r] - backward[r]) for r in range(4)]


PP2 = {"dims": {"pp": 2, "dp_replicate": 2}, "roles": {"pp": [[0, 1], [2, 3]]}}


def test_a_slower_last_stage_is_not_a_straggler():
    ranks = two_stages(forward={0: 0.2, 1: 0.4, 2: 0.2, 3: 0.4}, backward={0: 0.2, 1: 0.4, 2: 0.2, 3: 0.4})
    assert classify(ranks, context(**PP2)).label != "straggler"
    assert classify(ranks, context()).label == "straggler"


def test_a_rank_slower_than_its_stage_peer_is_a_straggler():
    ranks = two_stages(forward={0: 0.2, 1: 0.3, 2: 0.2, 3: 0.3}, backward={0: 0.2, 1: 0.4, 2: 0.4, 3: 0.4})
    diagnosis = classify(ranks, context(**PP2))
    assert (diagnosis.label, diagnosis.rank, diagnosis.phase) == ("straggler", 2, "backward")
    assert "against a median 0.30 s over 2 ranks of pp stage 0 (1.3x)" in diagnosis.evidence
    assert "1.3x slower in backward (0.40 s vs a median 0.30 s of pp stage 0)" in diagnosis.advice[0]
    assert classify(ranks, context()).label != "straggler"


def test_a_rank_without_peers_is_never_a_straggler():
    assert classify([times(0, forward=0.5)], context()).label == "compute-bound"
    ranks = [times(0, forward=0.2, backward=0.2, pipeline_idle=0.4), times(1, forward=0.4, backward=0.4)]
    assert classify(ranks, context({"pp": 2}, roles={"pp": [[0, 1]]})).label != "straggler"
    assert classify(ranks, context()).label == "straggler"


@pytest.mark.parametrize("field, below, above", [("straggler_ratio", 1.49, 1.51), ("straggler_share", 0.12, 0.13)])
def test_straggler_thresholds_at_the_edge(field, below, above):
    """Rank 3 is 1.5x the median (0.15 s vs 0.10 s), its 0.05 s extra 12.5% of a 0.4 s step."""
    ranks = [times(r, forward=0.15 if r == 3 else 0.10, step=0.4, backward=0.1) for r in range(4)]
    assert classify(ranks, context(), Thresholds(**{field: below})).label == "straggler"
    assert classify(ranks, context(), Thresholds(**{field: above})).label != "straggler"


def balanced(**phases: float) -> list[RankTimes]:
    return [times(r, **phases) for r in range(4)]


def test_data_bound_with_the_loader_settings():
    diagnosis = classify(balanced(data_wait=0.2, forward=0.2, backward=0.12), context(num_workers=0))
    assert diagnosis.label == "data-bound"
    assert "data wait 38% of the step" in diagnosis.advice[0] and "num_workers (now 0)" in diagnosis.advice[0]
    assert "pin_memory" in diagnosis.advice[0] and "persistent_workers" in diagnosis.advice[0]
    assert "38%" in diagnosis.evidence and "0.20 s of 0.52 s" in diagnosis.evidence
    unknown = classify(balanced(data_wait=0.2, forward=0.2, backward=0.12), context())
    assert "None" not in unknown.advice[0] and "now" not in unknown.advice[0]


@pytest.mark.parametrize("field, label, dims, part", [
    ("data_share", "data-bound", {}, {"data_wait": 0.2}),
    ("bubble_share", "pipeline-bubble", {"pp": 2}, {"pipeline_idle": 0.2}),
    ("comm_share", "communication-bound", {"tp": 2}, {"comm": {"tp": 0.2}}),
])
def test_shares_at_the_edge(field, label, dims, part):
    """The part takes 20% of a compute-heavy step: a threshold at 19% labels it, one at 21% does not."""
    ranks = balanced(forward=0.3, backward=0.5, **part)
    assert classify(ranks, context(dims), Thresholds(**{field: 0.19})).label == label
    assert classify(ranks, context(dims), Thresholds(**{field: 0.21})).label == "compute-bound"


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


def test_balanced_ranks_waiting_in_a_collective_count_for_its_role():
    """Transfer 0.10 s (25% of 0.4 s) is under 30%; with the 0.045 s mean wait (36%) it passes."""
    ranks = [times(0, {"tp": 0.10}, forward=0.15, backward=0.09, host=0.06),
             *(times(r, {"tp": 0.16}, forward=0.15, backward=0.09) for r in (1, 2, 3))]
    diagnosis = classify(ranks, context({"tp": 4}, roles={"tp": [[0, 1, 2, 3]]}))
    assert (diagnosis.label, diagnosis.dim) == ("communication-bound", "tp")
    assert "36%" in diagnosis.evidence and "0.045 s of it waiting" in diagnosis.evidence
    assert diagnosis.shares["comm:tp"] == pytest.approx(0.25)


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


def test_under_every_threshold_the_largest_part_labels():
    diagnosis = classify(balanced(comm={"cp": 0.28}, data_wait=0.18, host=0.27, forward=0.27), context({"cp": 2}))
    assert (diagnosis.label, diagnosis.dim) == ("communication-bound", "cp")
    assert "under its threshold" in diagnosis.evidence


def test_residual_is_reported_apart_never_a_label():
    diagnosis = classify(balanced(residual=0.3, forward=0.25, backward=0.25, host=0.2), context())
    assert diagnosis.label == "compute-bound"
    assert diagnosis.residual == pytest.approx(0.3) and diagnosis.shares["residual"] == pytest.approx(0.3)
    assert "30% of the step (0.30 s) is in no recorded phase" in diagnosis.evidence
    most = classify(balanced(residual=0.6, forward=0.25, host=0.15), context())
    assert most.label == "compute-bound" and most.residual == pytest.approx(0.6)
    small = classify(balanced(residual=0.04, forward=0.5, backward=0.46), context())
    assert "residual" not in small.evidence


def test_shares_partition_the_step():
    ranks = eight_ranks_one_slow()
    diagnosis = classify(ranks, context(roles={"fsdp": [list(range(8))]}))
    assert set(diagnosis.shares) == {*PHASES, "comm:fsdp", "compute", "residual"}
    parts = sum(diagnosis.shares[k] for k in (*PHASES, "comm:fsdp", "residual"))
    assert parts == pytest.approx(1.0)


def test_a_classifier_is_any_callable_of_ranks_and_context():
    assert typing.get_args(Classifier) == ([Sequence[RankTimes], WindowContext], Diagnosis)
    strict: Classifier = functools.partial(classify, thresholds=Thresholds(data_share=0.5))
    ranks = balanced(data_wait=0.3, forward=0.4)
    assert classify(ranks, context()).label == "data-bound" and strict(ranks, context()).label == "compute-bound"


def test_no_ranks_is_an_error_with_a_hint():
    with pytest.raises(ValueError, match="HINT"):
        classify([], context())


def test_zero_step_time_gives_a_diagnosis():
    diagnosis = classify([times(0), times(1)], context())
    assert diagnosis.label in LABELS and set(diagnosis.shares.values()) == {0.0}
    assert "no measurable time" in diagnosis.evidence
