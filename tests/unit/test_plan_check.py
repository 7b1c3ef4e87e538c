"""`python -m lightning_nd.plan ... --check`: each distinct rank's real setup and one step on fake tensors, in this
process, with the first error named by rank and module; the four first-step failures of N-D training caught."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.distributed as dist

from lightning_nd.check.world import FakeWorld, Hang, PeerFailed
from lightning_nd.planner.__main__ import main

LLAMA = ("--model", "examples.models.llama:Llama")


def _check(capsys, *argv: str) -> tuple[int, str]:
    before = set(threading.enumerate())
    code = main([*argv, "--check"])
    out, err = capsys.readouterr()
    left = set(threading.enumerate()) - before  # threads of the test worker itself may end meanwhile
    assert not dist.is_initialized() and not left, f"the fake world left nothing behind: {left}"
    return code, out + err


def test_a_4d_layout_sets_up_and_steps_on_every_stage(capsys):
    code, text = _check(capsys, *LLAMA, "--devices", "16", "--layout", "pp=2,dp_shard=2,cp=2,tp=2", "--options",
                        '{"sequence_parallel": true}', "--seq-len", "64")
    assert code == 0, text
    assert "| 0 | 0 | 0 | 0 | 0 | set up, one step (forward, backward, optimizer) |" in text
    assert "| 8 | 1 | 0 | 0 | 0 | set up, one step (forward, backward, optimizer) |" in text
    assert "Every checked rank set up and ran one training step" in text


def test_uneven_shards_check_the_last_coordinates_too(capsys):
    code, text = _check(capsys, *LLAMA, "--devices", "6", "--layout", "pp=2,dp_shard=3", "--seq-len", "16",
                        "--json")
    assert code == 0, text
    result = json.loads(text.splitlines()[0])
    assert sorted(o["rank"] for o in result["outcomes"]) == [0, 2, 3, 5]  # stage 0 and 1 at dp_shard 0 and 2
    assert {o["status"] for o in result["outcomes"]} == {"ok"}


@pytest.mark.parametrize("argv, rank, where, words", [
    pytest.param((*LLAMA, "--devices", "8", "--layout", "tp=2,pp=2,dp_shard=2", "--micro-batch", "2"), 0, None,
                 "The batch has 2 samples per rank, which pp_microbatches=4 does not divide", id="microbatches"),
    pytest.param((*LLAMA, "--devices", "4", "--layout", "tp=2,dp_shard=2", "--options", '{"sequence_parallel": true}',
                  "--seq-len", "63"), 0, None, "sequence length 63 does not divide by 2", id="sequence-parallel"),
    pytest.param(("--model", "tests.unit.check_models:TwiceInAStep", "--devices", "4", "--layout", "pp=2,dp_shard=2",
                  "--micro-batch", "4"), 2, None, "`TwiceInAStep.training_step` called the model 2 times in one step",
                 id="model-called-twice"),
    pytest.param(("--model", "tests.unit.check_models:max_norm_embedding", "--devices", "4", "--layout",
                  "tp=2,dp_shard=2"), 0, "model.embed_tokens (Embedding)",
                 "aten.embedding_renorm_.default does not have a sharding strategy", id="kernel-refuses-placement"),
    pytest.param(("--model", "tests.unit.check_models:max_norm_embedding", "--devices", "4", "--layout",
                  "pp=2,tp=2", "--micro-batch", "4"), 0, "model.embed_tokens (Embedding)",
                 "aten.embedding_renorm_.default does not have a sharding strategy", id="kernel-refuses-in-a-stage"),
])
def test_first_step_failures_are_named_with_rank_and_module(capsys, argv, rank, where, words):
    code, text = _check(capsys, *argv, "--seq-len", "32") if "--seq-len" not in argv else _check(capsys, *argv)
    assert code == 1, text
    assert f"First failure: rank {rank}{f' in `{where}`' if where else ''}:" in text
    assert words in text


def test_a_step_that_reads_routing_counts_is_not_checked_and_not_failed(capsys):
    code, text = _check(capsys, "--model", "tests.unit.check_models:experts", "--devices", "4", "--layout", "ep=2",
                        "--seq-len", "32")
    assert code == 3, text
    assert "No failure, but rank 0 could not be checked to the end" in text and "`model.layers.0.mlp (MoE)`" in text


def test_a_step_that_steps_nothing_is_not_called_checked(capsys):
    code, text = _check(capsys, "--model", "tests.unit.check_models:NoBatches", "--devices", "2", "--layout",
                        "dp_shard=2", "--seq-len", "16")
    assert code == 3, text
    assert "rank 0 ran no training step (fit ended after 0 optimizer steps, not 1)" in text


def test_a_hugging_face_model_given_with_weights_checks_under_interleaved_pp_and_tp(capsys):
    """Qwen3's per-head ``q_norm`` (whole on every tp rank, gradient summed) under an interleaved schedule: the
    check once refused it falsely, moving fake parameters the fake mode still remembered."""
    config = {"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64}
    code, text = _check(capsys, "--hf-model-type", "qwen3", "--hf-kwargs", json.dumps(config), "--devices", "4",
                        "--layout", "pp=2,tp=2", "--options",
                        '{"pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 2}', "--seq-len", "16",
                        "--micro-batch", "4")
    assert code == 0, text
    assert text.count("set up, one step (forward, backward, optimizer)") == 2


def test_a_step_reading_a_key_the_checks_batches_lack_is_told_to_give_its_dataloader(capsys):
    code, text = _check(capsys, "--model", "tests.unit.check_models:litgpt_reading_tokens", "--devices", "2",
                        "--layout", "dp_shard=2", "--seq-len", "16")
    assert code == 1, text
    assert "KeyError: 'tokens'" in text and "HINT: give the LightningModule a `train_dataloader`" in text


def test_a_litgpt_model_with_its_own_dataloader_checks_under_pp_and_tp(capsys):
    code, text = _check(capsys, "--model", "tests.unit.check_models:LitGPTWithData", "--devices", "4", "--layout",
                        "pp=2,tp=2")
    assert code == 0, text
    assert text.count("set up, one step (forward, backward, optimizer)") == 2


def test_check_needs_a_layout(capsys):
    assert main([*LLAMA, "--devices", "4", "--gpu-memory", "80GB", "--check"]) == 2
    assert "`--check` runs one layout" in capsys.readouterr().err


def _world(bodies: dict[int, object]) -> dict[int, BaseException | None]:
    ended: dict[int, BaseException | None] = {}

    def body(rank: int) -> None:
        try:
            bodies[rank]()  # type: ignore[operator]
            ended[rank] = None
        except BaseException as error:
            ended[rank] = error
            raise

    FakeWorld(4).run(sorted(bodies), body)
    return ended


def test_objects_reach_their_rank_in_order_and_a_broadcast_reaches_every_member():
    got: list[object] = []

    def sender() -> None:
        dist.send_object_list(["a"], dst=1)
        dist.send_object_list(["b"], dst=1)
        dist.broadcast_object_list(["all"], src=0)

    def receiver() -> None:
        for _ in range(2):
            box = [None]
            dist.recv_object_list(box, src=0)
            got.append(box[0])
        box = [None]
        dist.broadcast_object_list(box, src=0)
        got.append(box[0])

    assert _world({1: receiver, 0: sender, 2: lambda: dist.broadcast_object_list([None], src=0),
                   3: lambda: dist.broadcast_object_list([None], src=0)}) == {0: None, 1: None, 2: None, 3: None}
    assert got == ["a", "b", "all"]
    assert not dist.is_initialized()


def test_waiting_for_an_object_nobody_sends_is_a_hang_and_a_failed_peer_is_said():
    def waits_for(src: int):
        return lambda: dist.recv_object_list([None], src=src)

    ended = _world({0: waits_for(1), 1: waits_for(0)})
    assert all(isinstance(error, Hang) for error in ended.values())
    assert "rank 0 waits for rank 1; rank 1 waits for rank 0" in str(ended[0])

    def fails() -> None:
        raise ValueError("stage 0 broke")

    ended = _world({0: fails, 1: waits_for(0)})
    assert isinstance(ended[0], ValueError) and isinstance(ended[1], PeerFailed)
    assert torch.distributed.distributed_c10d._world.__class__.__name__ == "_World"


def test_integer_tensors_made_from_nothing_are_real_unless_they_are_huge():
    """Positions and small masks are made for real (code reads them); a [S, S] mask at a long sequence is fake, so
    the check needs none of the cluster's memory."""
    from torch._subclasses.fake_tensor import FakeTensor

    from lightning_nd.check.values import REAL_FACTORY_ELEMENTS, CheckTensorMode

    side = int(REAL_FACTORY_ELEMENTS ** 0.5) * 2
    with CheckTensorMode(allow_non_fake_inputs=True):
        made = {"positions": torch.arange(3, 99, 2), "mask": torch.ones(8, 8, dtype=torch.bool),
                "long mask": torch.ones(side, side, dtype=torch.bool), "long positions": torch.arange(side * side)}
    assert made["positions"].tolist()[:2] == [3, 5] and made["mask"].all()
    assert {name for name, value in made.items() if isinstance(value, FakeTensor)} == {"long mask", "long positions"}
