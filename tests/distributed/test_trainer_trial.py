"""One trial of the whole Trainer per layout (`trainer_trial_ranks.py`), against plain Lightning in one process: per
batch loss, accuracy and learning rate; every validation's logged values (the sanity check's included), the epochs'
aggregates; the best checkpoint's step and score, the early-stopping epoch; ``validate`` / ``test`` / ``predict`` from the
best checkpoint; the initial and final parameters; a stop mid-epoch and a resume from the file, then one at an epoch's
end with ``ckpt_path="auto"``; the same once in bf16-mixed. On every rank.

Tolerances: float32 within 1e-5 relative (measured: 2.3e-7 at most, parameters 2.3e-7 of their norm). bf16-mixed within
2e-2 relative of one process in bf16-mixed, parameters by the norm of their difference (measured: 1.5e-2 at most, the
parameters under dp_shard=2 x tp=2; plain Lightning DDP on the same run shows 1.1e-2 in a step's loss and 1.3e-2 in the
parameters, `benchmarks/trainer_trial_bf16.py`); accuracies are not compared in bf16, where one sample's rounding flips
them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.trainer_trial_ranks import RESUME_STOPS, TRAIN_BATCHES
from tests.launcher import launch

LAYOUTS = {
    2: {"fsdp2": {"dp_shard": 2}},
    4: {"fsdp2_tp2": {"dp_shard": 2, "tp": 2}, "hsdp2x2": {"dp_replicate": 2, "dp_shard": 2},
        "pp2_fsdp2": {"pp": 2, "dp_shard": 2}},
}
NAMES = [name for layouts in LAYOUTS.values() for name in layouts]
FLOAT32 = {"rel": 1e-5, "abs": 1e-7}
BF16 = {"rel": 2e-2, "abs": 1e-4}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("trial_reference")
    return launch("tests.distributed.trainer_trial_ranks:reference", 1, root / "out", timeout=300, root=str(root))[0]


@pytest.fixture(scope="module")
def trials(tmp_path_factory) -> dict[str, list[Any]]:
    """Each layout's results, rank by rank; ``console<world>``: what each rank of a launch printed."""
    found: dict[str, list[Any]] = {}
    for world, layouts in LAYOUTS.items():
        root = tmp_path_factory.mktemp(f"trial_{world}")
        ranks = launch("tests.distributed.trainer_trial_ranks:layouts", world, root / "out", timeout=600,
                       root=str(root), layouts=layouts)
        for name in layouts:
            found[name] = [rank[name] for rank in ranks]
        found[f"console{world}"] = [(root / "out" / f"rank{rank}.log").read_text() for rank in range(world)]
    return found


def assert_numbers(got: dict[str, float], expected: dict[str, float], tolerance: dict[str, float], where: str,
                   skip: tuple[str, ...] = ()) -> None:
    wanted = {name: value for name, value in expected.items() if not name.startswith(skip)}
    assert {name for name in got if not name.startswith(skip)} == set(wanted), where
    for name, value in wanted.items():
        assert got[name] == pytest.approx(value, **tolerance), f"{where}: {name}"


def assert_parameters(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float, where: str,
                      whole: bool = False) -> None:
    """Element by element within ``rtol`` of the value or of the tensor's largest value; ``whole``: the difference's
    norm within ``rtol`` of the tensor's (bf16 rounds single elements apart)."""
    assert got.keys() == expected.keys(), where
    for name, value in expected.items():
        if whole:
            assert float((got[name] - value).norm()) <= rtol * float(value.norm()), f"{where} {name}"
        else:
            torch.testing.assert_close(got[name], value, rtol=rtol, atol=rtol * float(value.abs().max()),
                                       msg=lambda m: f"{where} {name}: {m}")


def assert_run(ranks: list[dict[str, Any]], expected: dict[str, Any], tolerance: dict[str, float],
               skip: tuple[str, ...] = (), epochs: slice = slice(None)) -> None:
    """On every rank: the batches, validations, the epochs in ``epochs`` and the last step; the start and end
    parameters over the ranks (a pipeline stage holds its own)."""
    wanted = expected["record"]
    for rank, got in enumerate(ranks):
        record = got["record"]
        assert got["global_step"] == expected["global_step"], f"rank {rank}"
        assert len(record["batches"]) == len(wanted["batches"]), f"rank {rank}"
        for index, (batch, reference) in enumerate(zip(record["batches"], wanted["batches"])):
            assert_numbers(batch, reference, tolerance, f"rank {rank} batch {index}", skip)
        assert [v["step"] for v in record["validations"]] == [v["step"] for v in wanted["validations"]]
        for index, (logged, reference) in enumerate(zip(record["validations"], wanted["validations"])):
            assert_numbers(logged, reference, tolerance, f"rank {rank} validation {index}", skip)
        for index, (logged, reference) in enumerate(zip(record["epochs"][epochs], wanted["epochs"][epochs])):
            assert_numbers(logged, reference, tolerance, f"rank {rank} epoch {index}", skip)
    start = {name: value for got in ranks for name, value in got["record"]["start"].items()}
    end = {name: value for got in ranks for name, value in got["end"].items()}
    assert_parameters(start, wanted["start"], 0.0, "start")
    assert_parameters(end, expected["end"], tolerance["rel"], "end", whole=tolerance is BF16)


@pytest.mark.parametrize("layout", NAMES)
def test_fit_with_validation_checkpoints_and_early_stopping_matches_one_process(reference, trials, layout):
    expected = reference["shuffled"]
    ranks = [result["shuffled"] for result in trials[layout]]
    assert_run(ranks, expected, FLOAT32)
    assert len(expected["record"]["epochs"]) >= 3
    for got in ranks:
        assert (got["best_step"], got["stopped_epoch"]) == (expected["best_step"], expected["stopped_epoch"])
        assert got["best_score"] == pytest.approx(expected["best_score"], **FLOAT32)


@pytest.mark.parametrize("layout", NAMES)
def test_validate_test_and_predict_from_the_best_checkpoint_match_one_process(reference, trials, layout):
    expected = reference["shuffled"]
    for rank, result in enumerate(trials[layout]):
        got = result["shuffled"]
        for kind in ("validate", "test"):
            assert len(got[kind]) == len(expected[kind])
            for logged, wanted in zip(got[kind], expected[kind]):
                assert_numbers(logged, wanted, FLOAT32, f"rank {rank} {kind}")
        predicted = got["predict"]
        assert predicted and predicted.keys() <= expected["predict"].keys()
        for index, value in predicted.items():
            assert value["id"] == expected["predict"][index]["id"], f"rank {rank} sample {index}"
            torch.testing.assert_close(value["probs"], expected["predict"][index]["probs"], rtol=1e-5, atol=1e-7)
    covered = set().union(*(result["shuffled"]["predict"].keys() for result in trials[layout]))
    assert covered == expected["predict"].keys()


@pytest.mark.parametrize("layout", NAMES)
def test_fit_without_lightnings_sampler_matches_one_process(reference, trials, layout):
    assert_run([result["ordered"] for result in trials[layout]], reference["ordered"], FLOAT32)


@pytest.mark.parametrize("layout", NAMES)
def test_a_stop_mid_epoch_and_one_at_an_epochs_end_resume_as_if_uninterrupted(reference, trials, layout):
    """The epoch stopped in is aggregated in two parts, before the stop and after the resume: Lightning ends an epoch
    at ``max_steps`` and keeps no epoch aggregate (and torchmetrics no state) in a checkpoint, with or without
    lightning-nd."""
    expected = reference["resumed"]
    batches, epochs = expected["record"]["batches"], expected["record"]["epochs"]
    parts = [batches[TRAIN_BATCHES:RESUME_STOPS[0]], batches[RESUME_STOPS[0]:RESUME_STOPS[1]]]
    assert_run([result["resumed"] for result in trials[layout]], expected, FLOAT32, epochs=slice(0, 1))
    for rank, result in enumerate(trials[layout]):
        got = result["resumed"]["record"]["epochs"]
        assert len(got) == len(epochs) + 1, f"rank {rank}"
        for part, logged in zip(parts, got[1:3]):
            assert logged["seen"] == 8 * len(part)
            assert logged["train_loss_epoch"] == pytest.approx(sum(b["loss"] for b in part) / len(part), **FLOAT32)
            assert logged["train_acc_epoch"] == pytest.approx(sum(b["acc"] for b in part) / len(part), **FLOAT32)
        assert_numbers(got[3], epochs[2], FLOAT32, f"rank {rank} epoch 2")
    assert RESUME_STOPS[1] == 2 * TRAIN_BATCHES


@pytest.mark.parametrize("layout", NAMES)
def test_bf16_mixed_stays_within_the_spread_of_one_process(reference, trials, layout):
    assert_run([result["bf16"] for result in trials[layout]], reference["bf16"], BF16,
               skip=("acc", "val_acc", "train_acc"))


def test_the_mesh_and_a_skipped_pre_flight_are_said_once_per_process(trials):
    """Each launch fits, validates, tests and predicts 10 times per layout: rank 0 shows each layout's mesh once and says
    once that the cost model cannot read the MLP; the other ranks say neither."""
    for world, layouts in LAYOUTS.items():
        for rank, console in enumerate(trials[f"console{world}"]):
            assert console.count("lightning-nd mesh {") == (len(layouts) if rank == 0 else 0), f"rank {rank}"
            assert console.count("pre-flight skipped") == (rank == 0), f"rank {rank}"
