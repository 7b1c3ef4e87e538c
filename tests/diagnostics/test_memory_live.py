"""A rank of 4 really runs out of memory (`tests/distributed/memory_ranks.py`): every rank writes its memory
report and exits non-zero in time; the model state it measured is the shards the Layout says; the advice is
ranked, and each saving it promises is what a measured re-run with that change saves (within 15%)."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.distributed.memory_ranks import OOM_STEP, TIMEOUT_S
from tests.launcher import exits, launch, start

WORLD = 4
VICTIM = 2


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("oom")
    procs = start("tests.distributed.memory_ranks:oom", WORLD, root / "out", victim=VICTIM,
                  folder=str(root / "logs"), stamp=str(root / "stamp"))
    ended = exits(procs, timeout=180)
    logs = {rank: (root / "out" / f"rank{rank}.log").read_text() for rank in range(WORLD)}
    assert len(ended) == WORLD, f"ranks {set(range(WORLD)) - set(ended)} still ran:\n{logs}"
    assert (root / "stamp").exists(), f"the allocation never happened:\n{logs[VICTIM][-3000:]}"
    fault_at = (root / "stamp").stat().st_mtime
    reports = {}
    for rank, (code, at) in ended.items():
        assert code != 0, f"rank {rank} exited 0:\n{logs[rank][-3000:]}"
        assert at - fault_at <= TIMEOUT_S + 30, f"rank {rank} exited {at - fault_at:.1f} s after the allocation"
        path = root / "logs" / "diagnostics" / f"memory-rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote no memory report:\n{logs[rank][-3000:]}"
        reports[rank] = json.loads(path.read_text())
    return {"root": root, "logs": logs, "reports": reports}


def test_every_rank_reports_the_culprit_and_its_error(crashed):
    for rank, report in crashed["reports"].items():
        assert report["culprit"] == VICTIM and report["rank"] == rank
        assert report["dims"]["dp_replicate"] == 2 and report["dims"]["dp_shard"] == 2
        assert "lightning-nd" in crashed["logs"][rank] and f"rank {VICTIM}" in crashed["logs"][rank]
    assert "lightning-nd pre-flight: expected peak" in crashed["logs"][0]  # logged at the first batch
    own = crashed["reports"][VICTIM]
    assert own["step"] == OOM_STEP
    assert own["oom"]["device"] == "cpu" and own["oom"]["requested_bytes"] == 1 << 50


def test_model_state_measured_is_what_the_layout_holds(crashed):
    """Parameters, gradients (of the step before) and AdamW state, measured from the live model and optimizer,
    equal the cost model's figures from the Layout's shards, byte for byte; unknowns are said to be unknown."""
    for rank, report in crashed["reports"].items():
        figures = {f["kind"]: f for f in report["figures"]}
        for kind in ("params", "grads", "optimizer"):
            assert figures[kind]["measured_bytes"] == figures[kind]["expected_bytes"] > 0, (rank, kind, figures[kind])
        assert figures["activations"]["measured_bytes"] is None and figures["activations"]["expected_bytes"] > 0
        assert figures["total"]["source"] == "process peak RSS" and figures["total"]["measured_bytes"] > 0


def test_advice_is_ranked_and_shown_in_tensorboard(crashed):
    advice = crashed["reports"][VICTIM]["advice"]
    savings = [a["saving_bytes"] for a in advice]
    assert len(advice) >= 4 and savings == sorted(savings, reverse=True) and min(savings) > 0
    actions = [a["action"] for a in advice]
    assert any("activation_checkpointing='full'" in a for a in actions), actions
    assert any("dp_shard=4" in a for a in actions), actions  # HSDP -> FSDP over all four ranks
    events = EventAccumulator(str(next((crashed["root"] / "logs" / "tb").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    card = events.Tensors("diagnostics/memory/text_summary")[0].tensor_proto.string_val[0].decode()
    assert f"rank {VICTIM} ran out of memory" in card and "activation_checkpointing='full'" in card


def test_each_advised_saving_is_what_a_measured_rerun_saves(crashed, tmp_path):
    advice = crashed["reports"][VICTIM]["advice"]
    changes = [{}] + [a["change"] for a in advice]
    baseline, *after = launch("tests.distributed.memory_ranks:measure", WORLD, tmp_path, timeout=600,
                              changes=changes)[0]
    print("measured baseline", baseline, {a["action"]: (baseline - peak, a["saving_bytes"])
                                          for a, peak in zip(advice, after)})
    for item, peak in zip(advice, after):
        measured = baseline - peak
        assert measured == pytest.approx(item["saving_bytes"], rel=0.15), (item["action"], measured, item)



LAYOUTS = {
    "pp2_dp_shard2": ({"pp": 2, "dp_shard": 2}, 1, 0),  # ranks 0 and 1 run stage 0, which holds layers 0 and 1
    "dp_shard4": ({"dp_shard": 4}, 2, 0),
    "dp_shard2_tp2": ({"dp_shard": 2, "tp": 2}, 2, 0),
    "cp2_dp_shard2": ({"cp": 2, "dp_shard": 2}, 2, 0),
    "ep2_dp_shard4": ({"ep": 2, "dp_shard": 4}, 2, 4),
}
"""The fault matrix: layout, the rank whose allocation fails, the experts per MoE layer (0: dense)."""


@pytest.fixture(scope="module", params=list(LAYOUTS))
def crashed_under(request, tmp_path_factory) -> dict:
    layout, victim, experts = LAYOUTS[request.param]
    root = tmp_path_factory.mktemp(f"oom_{request.param}")
    procs = start("tests.distributed.memory_ranks:oom", WORLD, root / "out", victim=victim,
                  folder=str(root / "logs"), stamp=str(root / "stamp"), layout=layout, experts=experts)
    ended = exits(procs, timeout=180)
    logs = {rank: (root / "out" / f"rank{rank}.log").read_text() for rank in range(WORLD)}
    assert len(ended) == WORLD, f"ranks {set(range(WORLD)) - set(ended)} still ran:\n{logs}"
    assert (root / "stamp").exists(), f"the allocation never happened:\n{logs[victim][-3000:]}"
    return {"root": root, "logs": logs, "ended": ended, "layout": layout, "victim": victim}


def test_out_of_memory_is_reported_by_every_rank_under_every_layout_family(crashed_under):
    """Under pp torch's schedule re-raises the allocator's error as "[Stage 0] failed to run forward" (the message
    only in ``__cause__``): the culprit still reports its own out-of-memory error, its peers relay it. Under
    dp_shard, tp, cp and ep the error is the allocator's own."""
    logs, victim, layout = crashed_under["logs"], crashed_under["victim"], crashed_under["layout"]
    if layout.get("pp", 1) > 1:
        assert "failed to run forward" in logs[victim], logs[victim][-3000:]
    for rank, (code, _) in crashed_under["ended"].items():
        assert code != 0, f"rank {rank} exited 0:\n{logs[rank][-3000:]}"
        path = crashed_under["root"] / "logs" / "diagnostics" / f"memory-rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote no memory report:\n{logs[rank][-3000:]}"
        report = json.loads(path.read_text())
        assert report["culprit"] == victim, (rank, report["culprit"])
        assert all(report["dims"][dim] == size for dim, size in layout.items()), report["dims"]
    own = json.loads((crashed_under["root"] / "logs" / "diagnostics" / f"memory-rank{victim}.json").read_text())
    assert own["step"] == OOM_STEP and own["oom"]["device"] == "cpu" and own["oom"]["requested_bytes"] == 1 << 50
