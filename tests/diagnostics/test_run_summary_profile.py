"""`RunSummary(profile=...)`: the run record's predicted step priced by a host's measured profile (the one the layout
search ranked with), the model's operations counted from the strategy's `LayoutReady`, and the comparison table
saying what priced it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from diagnostics import RunSummary
from diagnostics.analysis.compare import compare
from diagnostics.records import RUN_FILE, RunRecord, find_runs, to_json
from diagnostics.report.compare_card import compare_markdown
from examples.models.llama import Llama, LlamaConfig
from lightning_nd.cost.op_count import count_model_ops
from lightning_nd.strategy.events import LayoutReady
from tests.distributed.meta_starts_ranks import conf_model
from tests.unit.host_profiles import synthetic_profile


def test_a_profile_and_a_preset_together_or_a_missing_file_are_refused(tmp_path):
    path = synthetic_profile().save(tmp_path / "p.json")
    with pytest.raises(ValueError, match="both price the predicted step. HINT: pass one"):
        RunSummary(hardware="cpu", profile=str(path))
    with pytest.raises(ValueError, match="nowhere.json` is not a readable profile"):
        RunSummary(profile=str(tmp_path / "nowhere.json"))
    assert RunSummary(profile=str(path)).profile == synthetic_profile()


def test_the_models_operations_are_counted_when_the_layout_is_ready_on_rank_zero_only(tmp_path):
    path = str(synthetic_profile().save(tmp_path / "p.json"))
    model = Llama(LlamaConfig(**conf_model("llama")))
    counted, other_rank, no_profile = RunSummary(profile=path), RunSummary(profile=path), RunSummary()
    counted.on_nd_layout_ready(SimpleNamespace(global_rank=0), LayoutReady(layout=None, model=model))
    other_rank.on_nd_layout_ready(SimpleNamespace(global_rank=1), LayoutReady(layout=None, model=model))
    no_profile.on_nd_layout_ready(SimpleNamespace(global_rank=0), LayoutReady(layout=None, model=model))
    assert counted.ops == count_model_ops(model) is not None
    assert other_rank.ops is None and no_profile.ops is None


def test_the_table_says_what_priced_its_predictions(tmp_path):
    for name, hardware in (("0", "profile of vm (measured 2025-01-01)"), ("1", "cpu"), ("2", None)):
        folder = tmp_path / name / "diagnostics"
        folder.mkdir(parents=True)
        record = RunRecord("ok", "", (f"parallel=run{name}",), {"dp_shard": 4}, {}, steps=4, step_s=0.1,
                           tokens_per_s=1000.0 + float(name), predicted_step_s=0.12 if hardware else None,
                           hardware=hardware)
        (folder / RUN_FILE).write_text(to_json(record))
    table = compare_markdown(compare(find_runs(tmp_path)), str(tmp_path))
    assert "Predicted steps priced by: cpu; profile of vm (measured 2025-01-01)." in table
    assert json.loads((tmp_path / "0" / "diagnostics" / RUN_FILE).read_text())["hardware"].startswith("profile of")
