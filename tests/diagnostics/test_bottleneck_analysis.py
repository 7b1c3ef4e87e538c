"""The bottleneck classifier (`diagnostics/analysis/bottleneck.py`) on hand-built windows: stragglers named with
their rank and phase, sought within a pp stage and put before the communication they cause; the waiting moved out
of the collectives group by group; the residual kept apart; the shares partitioning the step; the thresholds at
their edges. The advice each class gives is checked in test_bottleneck_advice.py."""

from __future__ import annotations

import functools
import typing
from collections.abc import Sequence

import pytest

from diagnostics.analysis.bottleneck import Classifier, Thresholds, attribute_waiting, classify, waiting_by_role
from diagnostics.records import LABELS, PHASES, Diagnosis, RankTimes, WindowContext
from tests.diagnostics.bottleneck_cases import balanced, context, eight_ranks_one_slow, times


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


def test_balanced_ranks_waiting_in_a_collective_count_for_its_role():
    """Transfer 0.10 s (25% of 0.4 s) is under 30%; with the 0.045 s mean wait (36%) it passes."""
    ranks = [times(0, {"tp": 0.10}, forward=0.15, backward=0.09, host=0.06),
             *(times(r, {"tp": 0.16}, forward=0.15, backward=0.09) for r in (1, 2, 3))]
    diagnosis = classify(ranks, context({"tp": 4}, roles={"tp": [[0, 1, 2, 3]]}))
    assert (diagnosis.label, diagnosis.dim) == ("communication-bound", "tp")
    assert "36%" in diagnosis.evidence and "0.045 s of it waiting" in diagnosis.evidence
    assert diagnosis.shares["comm:tp"] == pytest.approx(0.25)


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
