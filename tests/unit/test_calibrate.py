"""`calibrate`: one real calibration on 2 CPU processes within its budget, every number it writes positive and
finite; its refusals before any process starts."""

from __future__ import annotations

import math
import time

import pytest

from lightning_nd.cost import calibrate as calibrate_module
from lightning_nd.cost.calibrate import calibrate
from lightning_nd.cost.profile import COLLECTIVES, HostProfile

BUDGET_S = 8.0


def _numbers(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def test_a_real_calibration_measures_everything_within_its_budget(tmp_path):
    lines = []
    start = time.perf_counter()
    profile = calibrate((2,), shapes=[(32, 32, 32), (128, 128, 128)], processes=2, budget_s=BUDGET_S,
                        progress=lines.append)
    assert time.perf_counter() - start <= BUDGET_S + 5, lines
    assert (profile.backend, profile.processes) == ("gloo", 2) and profile.calibration_s <= BUDGET_S + 5
    record = profile.to_dict()
    assert all(math.isfinite(n) and n > 0 for n in _numbers(record)), record
    assert {(c.kind, c.group_size) for c in profile.collectives} == {(kind, 2) for kind in COLLECTIVES}
    assert all(len(c.samples) >= 3 for c in profile.collectives)
    assert profile.matmul[0].m == 32 and profile.matmul_seconds(64, 64, 64, "float32") > 0
    assert lines[0].startswith("calibrating: starting 2 processes (gloo)"), lines
    assert "calibrating: matmul 1/2 32x32x32 float32" in lines and all(line.startswith("calibrating: ") for line in lines)
    assert HostProfile.load(profile.save(tmp_path / "p.json")) == profile


@pytest.mark.parametrize(("arguments", "match"), [
    ({"world_sizes": (8,), "processes": 4}, r"groups larger than its 4 processes. HINT: pass `processes=8`"),
    ({"processes": 0}, "runs no process"),
    ({"processes": 2, "dtypes": ("float33",)}, r"\['float33'\] not torch dtypes"),
    ({"processes": 2, "budget_s": 1}, "leaves no time to measure"),
])
def test_calibrate_refuses_before_starting_a_process(monkeypatch, arguments, match):
    monkeypatch.setattr(calibrate_module, "_run", pytest.fail)
    with pytest.raises(ValueError, match=match):
        calibrate(**arguments)


def test_default_group_sizes_are_the_divisors_above_one():
    assert calibrate_module.default_group_sizes(8) == [2, 4, 8]
    assert calibrate_module.default_group_sizes(1) == []
