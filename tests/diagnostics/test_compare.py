"""A sweep's comparison, offline: how a failure is named (`diagnostics/analysis/outcome.py`, on the messages torch,
gloo, NCCL and the strategy really print), where runs are found in a sweep's folder (Hydra's job folders, nested
search jobs, plain log dirs, records missing or cut short), the ranking and its margin, the table, JSON and card,
``python -m diagnostics compare`` and the Hydra callback that prints it at the end of a sweep. The runs themselves
are in tests/e2e/test_train.py; rank 0's record of real hangs and crashes in tests/diagnostics/test_hang_live.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from diagnostics.analysis.compare import compare, layout_name
from diagnostics.analysis.outcome import classify, reason
from diagnostics.records import RUN_FILE, RunRecord, find_runs, to_json

GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting"
                " 5000ms for recv operation to complete")
NCCL_TIMEOUT = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1,"
                " NumelOut=1, Timeout(ms)=600000) ran for 600030 milliseconds before timing out.")
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.2"
            " GiB is free.")
PEER_DIED = "rank 1: died: no heartbeat for 5 s after a collective broke (killed, crashed or out of memory)"
REFUSAL = ("The other dims multiply to 3, which does not divide world_size=4, so `dp_shard=-1` cannot fill the rest."
           " HINT: choose dims whose product divides 4 (divisors: [1, 2, 4]).")


@pytest.mark.parametrize("names, message, stepped, status", [
    (("RuntimeError", "Exception"), GLOO_TIMEOUT, True, "hang"),
    (("DistBackendError", "RuntimeError"), NCCL_TIMEOUT, True, "hang"),
    (("OutOfMemoryError", "RuntimeError"), CUDA_OOM, True, "oom"),
    (("RuntimeError",), "[Stage 0] failed to run forward:\n" + CUDA_OOM, False, "oom"),
    (("RuntimeError",), PEER_DIED + "\n[Stage 0] failed to run forward:", True, "crash"),
    (("RuntimeError",), "Connection closed by peer [127.0.0.1]:29500", True, "crash"),
    (("ValueError", "Exception"), REFUSAL, False, "refused"),
    (("ValueError", "Exception"), REFUSAL, True, "crash"),  # after a step: not a refusal before training
    (("ValueError",), "index 7 is out of bounds", False, "crash"),  # no HINT: not the library's refusal
    (("IndexError", "LookupError"), "index out of range in self", False, "crash"),
    (("DistBackendError",), NCCL_TIMEOUT + " The rank that died is unknown.", True, "hang"),
    (("RuntimeError",), "the model studied 3 batches", True, "crash"),  # "died" as a word only
    (("RuntimeError",), "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB", True, "oom"),
    (("ValueError",), "`NDParallel` has no option `tp_size`. HINT: did you mean `tp`? Options: timeout, init_timeout",
     False, "refused"),  # an option named "timeout" is no hang
])
def test_a_failure_is_named_from_the_error_torch_printed(names, message, stepped, status):
    assert classify(names, message, stepped) == status


def test_the_reason_is_the_first_sentence_and_the_hint():
    assert reason("ValueError", REFUSAL + "\nmore") == ("ValueError: The other dims multiply to 3, which does not"
                                                       " divide world_size=4, so `dp_shard=-1` cannot fill the rest."
                                                       " HINT: choose dims whose product divides 4 (divisors: [1, 2,"
                                                       " 4]).")
    assert reason("ValueError", "Use `a.b`. Then more.") == "ValueError: Use `a.b`."
    assert len(reason("RuntimeError", "x" * 1000)) == 300
    assert reason("KeyError", "") == "KeyError: (no message)"


def ok(tokens: float, dims: dict | None = None, **fields) -> RunRecord:
    fields = {"global_batch": 32, "first_loss": 5.7, **fields}
    return RunRecord("ok", dims=dims or {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1, "ep": 1},
                     options={"zero_stage": 3, "activation_checkpointing": "none"}, steps=5, final_loss=4.5,
                     tokens_per_s=tokens, step_s=0.1, peak_bytes=(4e8, 3.9e8), memory_kind="peak_rss",
                     bottleneck="communication-bound", predicted_step_s=0.002, predicted_peak_bytes=6e6,
                     hardware="cpu", **fields)


def job(folder: Path, overrides: list[str], record: RunRecord | str | None) -> Path:
    """A Hydra job folder: ``.hydra/overrides.yaml``, and the record where the example writes it."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if record is not None:
        path = folder / "tensorboard" / "diagnostics" / RUN_FILE
        path.parent.mkdir(parents=True)
        path.write_text(record if isinstance(record, str) else to_json(record))
    return folder


def test_runs_are_found_in_a_sweep_folder_whatever_they_left(tmp_path):
    job(tmp_path / "0", ["parallel=fsdp"], ok(100.0))
    job(tmp_path / "1", ["parallel=tp"], None)  # killed: no record
    job(tmp_path / "2", ["parallel=cp"], '{"status": "ok", "tokens_per')  # cut short by a dying process
    job(tmp_path / "10", ["parallel=ddp"], RunRecord("refused", "ValueError: no.", ("parallel=ddp",)))
    search = job(tmp_path / "3", ["parallel=search"], None)  # a search job: its measured runs are the rows
    job(search / "runs" / "0", ["parallel=fsdp", "data.batch_size=8"], ok(50.0))
    plain = tmp_path / "elsewhere" / "logs" / "diagnostics"  # a run.json outside any Hydra job
    plain.mkdir(parents=True)
    (plain / RUN_FILE).write_text(to_json(ok(10.0)))
    found = {run.name: run for run in find_runs(tmp_path)}
    assert list(found) == ["0", "1", "2", "3/runs/0", "10", "elsewhere/logs"]
    assert found["0"].record == ok(100.0) and found["0"].overrides == ("parallel=fsdp",)
    assert found["1"].record is None and found["1"].problem == ""
    assert found["2"].record is None and "unreadable" in found["2"].problem
    assert found["10"].overrides == ("parallel=ddp",) and found["10"].record.status == "refused"
    assert found["3/runs/0"].overrides == ("parallel=fsdp", "data.batch_size=8")
    assert find_runs(tmp_path / "3") == [found["3/runs/0"].__class__(**{**found["3/runs/0"].__dict__,
                                                                         "name": "runs/0"})]


def test_every_run_is_a_row_fastest_first_then_the_failures(tmp_path):
    job(tmp_path / "0", ["parallel=fsdp", "trainer.devices=4"], ok(100.0))
    job(tmp_path / "1", ["parallel=tp", "trainer.devices=4"], ok(150.0, {"pp": 1, "dp_replicate": 1, "dp_shard": 2,
                                                                          "cp": 1, "tp": 2, "ep": 1}))
    job(tmp_path / "2", ["parallel=refused", "trainer.devices=4"], RunRecord("refused", "ValueError: no."))
    job(tmp_path / "3", ["parallel=cp", "trainer.devices=4"], None)
    result = compare(find_runs(tmp_path))
    assert [(r.name, r.status) for r in result.rows] == [("1", "ok"), ("0", "ok"), ("2", "refused"), ("3", "crash")]
    assert result.best.name == "1" and result.runner_up.name == "0" and result.margin == pytest.approx(0.5)
    assert result.rows[0].layout == "dp_shard=2,tp=2" and result.rows[0].varied == ("parallel=tp",)
    assert result.rows[2].layout == "parallel=refused" and "left no run record" in result.rows[3].reason
    assert result.rows[0].step_ratio == pytest.approx(0.02) and result.rows[0].memory_ratio is None  # RSS: not alike
    assert result.notes == ()


def test_a_close_margin_and_a_sweep_that_measured_nothing_say_so(tmp_path):
    job(tmp_path / "0", ["parallel=fsdp"], ok(100.0))
    job(tmp_path / "1", ["parallel=ddp"], ok(102.0))
    assert "within a shared machine's noise" in compare(find_runs(tmp_path)).notes[0]
    failed = tmp_path / "failed"
    job(failed / "0", ["parallel=fsdp"], RunRecord("oom", "OutOfMemoryError: CUDA out of memory."))
    result = compare(find_runs(failed))
    assert result.best is None and "No run trained long enough" in result.notes[0]
    assert compare([]).notes[0].startswith("No run found")


def test_a_row_of_another_global_batch_is_flagged_and_runs_that_started_apart_are_named(tmp_path, capsys):
    """The sweep that read as a difference between layouts: the example GPT's dp runs started at 41.8 and 43.1 (its
    tied head untied by materialising), the tp run at 5.74; a run of another global batch beside them."""
    from diagnostics import CompareSweep

    job(tmp_path / "0", ["parallel=fsdp"], ok(100.0, first_loss=41.8))
    job(tmp_path / "1", ["parallel=hsdp"], ok(90.0, first_loss=43.1))
    job(tmp_path / "2", ["parallel=tp"], ok(120.0, first_loss=5.74))
    job(tmp_path / "3", ["parallel=cp"], ok(80.0, global_batch=16, first_loss=5.7))
    result = compare(find_runs(tmp_path))
    assert [(r.name, r.other_batch) for r in result.rows] == [("2", None), ("0", None), ("1", None), ("3", 32)]
    assert any("Runs 3 trained another global batch than the best (32 samples per step)" in n for n in result.notes)
    spread = [n for n in result.notes if "started from first-step losses" in n]
    assert spread == ["Runs of global batch 32 started from first-step losses 5.74 (run 2) to 43.1 (run 1): they"
                      " trained different models, so their final losses say nothing about the layouts. HINT: build"
                      " and seed the model the same way in every run."]
    CompareSweep(tensorboard=False).on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    printed = capsys.readouterr().out
    assert "| 3: parallel=cp | `dp_shard=4` | ok | **16 (best: 32)** | 80 |" in printed
    assert "| **2: parallel=tp** | `dp_shard=4` | ok | 32 | 120 |" in printed and "| 41.8 | 4.5 |" in printed
    rows = {row["name"]: row for row in json.loads((tmp_path / "compare.json").read_text())["rows"]}
    assert rows["3"]["global_batch_differs"] and not rows["0"]["global_batch_differs"]
    assert rows["0"]["record"]["global_batch"] == 32 and rows["0"]["record"]["first_loss"] == 41.8


def test_starts_within_a_seeds_spread_and_records_without_a_batch_are_not_flagged(tmp_path):
    job(tmp_path / "0", ["parallel=fsdp"], ok(100.0, first_loss=41.8))
    job(tmp_path / "1", ["parallel=tp"], ok(120.0, first_loss=43.1))
    job(tmp_path / "2", ["parallel=ddp"], ok(90.0, global_batch=None, first_loss=None))  # an older run.json
    result = compare(find_runs(tmp_path))
    assert all(r.other_batch is None for r in result.rows) and result.notes == ()


def test_a_layout_is_named_by_its_dims_and_the_options_that_are_not_the_defaults():
    pipelined = ok(1.0, {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1})
    pipelined = RunRecord(**{**pipelined.__dict__, "options": {"zero_stage": 2, "activation_checkpointing": "full",
                                                               "pp_schedule": "1f1b", "pp_microbatches": 8}})
    assert layout_name(pipelined, ()) == ("pp=2,dp_shard=2 zero_stage=2 activation_checkpointing=full"
                                          " pp_schedule=1f1b pp_microbatches=8")
    assert layout_name(None, ("trainer.devices=4", "+parallel.tp=3")) == "+parallel.tp=3"
    assert layout_name(None, ()) == "(default layout)"


def test_the_command_writes_the_table_json_and_card_and_its_status_says_if_one_won(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from diagnostics.__main__ import main

    assert main(["compare", str(tmp_path / "nothing")]) == 2
    assert main(["compare", str(tmp_path)]) == 2 and "no run under" in capsys.readouterr().err
    job(tmp_path / "0", ["parallel=fsdp"], ok(100.0))
    job(tmp_path / "1", ["parallel=hang"], RunRecord("hang", "rank 3 (tp 1) never joined all_reduce."))
    assert main(["compare", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "Best: `dp_shard=4` (run 0), 100 tokens/s." in printed and "Only one run was measured" in printed
    assert "| 1: parallel=hang | `parallel=hang` | HANG: rank 3 (tp 1) never joined all_reduce. |" in printed
    assert ("| **0: parallel=fsdp** | `dp_shard=4` | ok | 32 | 100 | 100 ms | 2 ms (0.02x) |"
            " 381.5 MiB / 371.9 MiB RSS |" in printed)
    assert "| communication-bound | 5.7 | 4.5 |" in printed
    assert (tmp_path / "compare.md").read_text() == printed.rstrip("\n") + "\n"
    assert main(["compare", str(tmp_path), "--json", "--no-tensorboard"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert said["best"] == "0" and said["best_overrides"] == "parallel=fsdp" and said["rows"][1]["status"] == "hang"
    card = EventAccumulator(str(tmp_path / "compare"), size_guidance={"tensors": 0})
    card.Reload()
    assert "diagnostics/compare/text_summary" in card.Tags()["tensors"]
    (tmp_path / "0" / "tensorboard" / "diagnostics" / RUN_FILE).unlink()
    assert main(["compare", str(tmp_path), "--no-tensorboard"]) == 1  # nothing trained: no best


def test_the_sweep_callback_prints_the_table_once_and_fails_a_sweep_with_no_winner(tmp_path, capsys, monkeypatch):
    from diagnostics import CompareSweep

    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    job(tmp_path / "0", ["parallel=fsdp"], ok(100.0))
    monkeypatch.setenv("LOCAL_RANK", "1")  # another rank's process, which Lightning started with the sweep's args
    CompareSweep(tensorboard=False).on_multirun_end(config)
    assert capsys.readouterr().out == "" and not (tmp_path / "compare.md").exists()
    monkeypatch.delenv("LOCAL_RANK")
    CompareSweep(tensorboard=False).on_multirun_end(config)
    assert "Best: `dp_shard=4`" in capsys.readouterr().out
    failed = tmp_path / "failed"
    job(failed / "0", ["parallel=fsdp"], RunRecord("crash", "IndexError: index out of range in self"))
    with pytest.raises(SystemExit) as stopped:
        CompareSweep(tensorboard=False).on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(failed)}}}))
    assert stopped.value.code == 1 and "CRASH: IndexError" in capsys.readouterr().out


def test_a_sweep_of_one_search_job_is_not_compared_twice(tmp_path, capsys):
    from diagnostics import CompareSweep

    search = job(tmp_path / "0", ["parallel=search"], None)
    job(search / "runs" / "0", ["parallel=fsdp"], ok(100.0))
    (search / "compare.md").write_text("the search's own table\n")
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    CompareSweep(tensorboard=False).on_multirun_end(config)
    assert capsys.readouterr().out == ""
    job(tmp_path / "1", ["parallel=ddp"], ok(50.0))  # a search among other jobs: the sweep's table covers all
    CompareSweep(tensorboard=False).on_multirun_end(config)
    assert "| **0/runs/0: parallel=fsdp** |" in capsys.readouterr().out


def test_a_run_refused_before_any_trainer_leaves_its_record(tmp_path):
    from diagnostics import RunSummary
    from lightning_nd import NDParallel

    summary = RunSummary(log_dir=str(tmp_path), overrides=["parallel.tp=3"])
    with pytest.raises(ValueError) as refused:
        NDParallel.from_config({"tp": 3, "dq": 1})
    record = summary.write_failure(refused.value)
    assert record.status == "refused" and "has no option `dq`" in record.reason and "HINT" in record.reason
    assert json.loads((tmp_path / "diagnostics" / RUN_FILE).read_text())["overrides"] == ["parallel.tp=3"]
    with pytest.raises(ValueError, match="Unknown hardware"):
        RunSummary(hardware="h1000")
