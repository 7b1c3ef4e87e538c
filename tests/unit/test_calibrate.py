"""`calibrate`: one real calibration on 2 CPU processes (stopped with an error past its budget; how long it takes
is measured by `--calibrate` itself, not asserted: a loaded host starts processes slower), every number it writes
positive and finite; its refusals before any process starts; and the planner's flags that measure and choose a profile."""

from __future__ import annotations

import json
import math
import time

import pytest

from lightning_nd.cost import calibrate as calibrate_module
from lightning_nd.cost.calibrate import calibrate
from lightning_nd.cost.framework_benchmarks import median_overheads
from lightning_nd.cost.profile import COLLECTIVES, HostProfile, cache_path
from lightning_nd.planner.__main__ import build_parser, main
from lightning_nd.planner.pricing import pricing
from tests.unit.host_profiles import synthetic_profile

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
    timeline = []
    start = time.perf_counter()
    profile = calibrate((2,), shapes=[(32, 32, 32), (128, 128, 128)], processes=2, budget_s=BUDGET_S,
                        progress=lambda line: timeline.append((round(time.perf_counter() - start, 2), line)))
    lines = [line for _, line in timeline]  # past budget + GRACE_S the run is stopped with an error, so none here
    assert (profile.backend, profile.processes) == ("gloo", 2) and profile.calibration_s > 0
    record = profile.to_dict()
    assert record["framework"][0].pop("pp_microbatch_s") == 0.0  # one rank is no pipeline
    assert [row.pop("fsdp_tp_unit_s") for row in record["framework"]] == [0.0, 0.0]  # 2 ranks hold no 2 x 2 mesh
    assert all(math.isfinite(n) and n > 0 for n in _numbers(record)), record
    assert {(c.kind, c.group_size) for c in profile.collectives} == {(kind, 2) for kind in COLLECTIVES}
    assert all(len(c.samples) >= 3 for c in profile.collectives)
    assert profile.matmul[0].m == 32 and profile.matmul_seconds(64, 64, 64, "float32") > 0
    assert [point.group_size for point in profile.framework] == [1, 2] and profile.adam_tensor_s > 0
    assert all(len(c.in_step) == 2 and c.in_step[0][0] < c.in_step[1][0] for c in profile.collectives)
    assert profile.cores >= 1 and [work for work, _ in profile.utilization] == [w for w, _ in profile.collectives[0].in_step]
    assert all(0 < share <= 1 for _, share in profile.utilization), profile.utilization
    assert len(profile.attention) == 2 and profile.attention_seconds(8, 32, 8) > 0
    overheads = [line for line in lines if line.startswith("calibrating: per-call overheads, round ")]
    assert [line.split(":")[1] for line in overheads] == [f" per-call overheads, round {i}/3" for i in (1, 2, 3)]
    assert lines.index(overheads[1]) < min(i for i, line in enumerate(lines) if "inside a step" in line), lines
    assert lines.index(overheads[2]) < min(i for i, line in enumerate(lines) if "collective 1/" in line), lines
    assert lines[0].startswith("calibrating: starting 2 processes (gloo)"), lines
    assert "calibrating: matmul 1/2 32x32x32 float32" in lines and all(line.startswith("calibrating: ") for line in lines)
    assert HostProfile.load(profile.save(tmp_path / "p.json")) == profile


def test_the_overheads_are_the_median_of_their_rounds_so_one_stalled_window_moves_nothing():
    rounds = [{"op_overhead_s": 3e-6, "adam_tensor_s": 5e-5, "framework": [[1, 0.5e-3, 0.1], [4, 12e-3, 2e-3]]},
              {"op_overhead_s": 9e-6, "adam_tensor_s": 4e-5, "framework": [[1, 0.7e-3, 0.1], [4, 30e-3, 1e-3]]},
              {"op_overhead_s": 4e-6, "adam_tensor_s": 6e-5, "framework": [[1, 0.6e-3, 0.3], [4, 13e-3, 3e-3]]}]
    assert median_overheads(rounds) == {"op_overhead_s": 4e-6, "adam_tensor_s": 5e-5,
                                        "framework": [[1, 0.6e-3, 0.1], [4, 13e-3, 2e-3]]}
    assert median_overheads([{"op_overhead_s": 2e-6}, {"op_overhead_s": 4e-6}]) == {"op_overhead_s": 3e-6}  # on GPU


def test_the_busy_share_is_the_ranks_processor_time_over_the_cores_wall_time_per_amount_of_work():
    ranks = [{"busy": [[1e-3, 0.30, 0.50], [10e-3, 0.45, 0.50]]}, {"busy": [[1.2e-3, 0.20, 0.50], [11e-3, 0.55, 0.50]]},
             {"busy": [[1.1e-3, 0.30, 0.60], [9e-3, 0.50, 0.60]]}, {"busy": [[1e-3, 0.20, 0.40], [10e-3, 0.50, 0.40]]}]
    assert calibrate_module._utilization(ranks, 2) == (pytest.approx((1.05e-3, 1.0 / 2 / 0.5)), (10e-3, 1.0))
    assert calibrate_module._utilization(ranks, 4) == (pytest.approx((1.05e-3, 0.5)), pytest.approx((10e-3, 1.0)))
    assert calibrate_module._utilization([*ranks[:3], {}], 2) == ()  # a rank that measured none: none


@pytest.mark.parametrize(("changes", "warned"), [
    ({"processes": 4, "cores": 2, "utilization": ((1e-3, 0.65), (12e-3, 0.71))}, True),  # beside a test run
    ({"processes": 4, "cores": 2, "utilization": ((1e-3, 0.82), (12e-3, 0.95))}, False),  # idle
    ({"processes": 4, "cores": 4, "utilization": ((1e-3, 0.5), (12e-3, 0.6))}, False),  # a core each: not used
    ({"processes": 4, "cores": 2, "utilization": ()}, False),  # not measured
])
def test_a_calibration_whose_cores_stayed_idle_says_another_process_ran_beside_it(monkeypatch, changes, warned):
    profile = synthetic_profile(**changes)
    monkeypatch.setattr(calibrate_module, "_run", lambda *_: [])
    monkeypatch.setattr(calibrate_module, "_profile", lambda *_: profile)
    lines: list[str] = []
    assert calibrate((2,), processes=4, progress=lines.append) is profile
    warnings = [line for line in lines if "busy after" in line]
    assert len(warnings) == warned
    if warned:
        assert warnings[0] == (
            "calibrating: the 4 processes kept only 71% of the 2 cores busy after 12.0 ms of work between calls (an"
            " idle host: 85% or more): another process probably ran beside the calibration, and every layout is"
            " priced too slow. Measure again when the host is idle: `python -m lightning_nd.plan --calibrate"
            " --refresh-profile`")


@pytest.mark.parametrize(("arguments", "match"), [
    ({"world_sizes": (8,), "processes": 4}, r"groups larger than its 4 processes. HINT: pass `processes=8`"),
    ({"processes": 0}, "runs no process"),
    ({"processes": 2, "dtypes": ("float33",)}, r"\['float33'\] not torch dtypes"),
    ({"processes": 2, "budget_s": 1}, "leaves no time to measure"),
    ({"processes": 2, "shapes": [(64, 0, 64)]}, "each shape is \\(m, n, k\\), all positive"),
])
def test_calibrate_refuses_before_starting_a_process(monkeypatch, arguments, match):
    monkeypatch.setattr(calibrate_module, "_run", pytest.fail)
    with pytest.raises(ValueError, match=match):
        calibrate(**arguments)


def test_a_process_that_fails_stops_the_calibration_with_its_log():
    """It stops when the process fails, not when its budget is spent: a budget far above what starting two processes
    takes on a loaded host (up to 12 s; 32 s once beside a 32-rank launch), so only a calibration that waited for it
    runs past half of it."""
    budget = 300.0
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"Calibration process \d failed; its log:\n(.|\n)*Float8") as failed:
        calibrate((2,), dtypes=("float8_e4m3fn",), processes=2, budget_s=budget, progress=lambda line: None)
    assert time.perf_counter() - start < budget / 2, failed.value


def test_default_group_sizes_are_the_divisors_above_one():
    assert calibrate_module.default_group_sizes(8) == [2, 4, 8]
    assert calibrate_module.default_group_sizes(1) == []


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """The profile cache in ``tmp_path``; a calibration returns `synthetic_profile` at once, counted."""
    monkeypatch.setenv("LIGHTNING_ND_PROFILE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(calibrate_module, "calibrate",
                        lambda *args: calls.append(args) or synthetic_profile(processes=args[3] or 8))
    return calls


def test_calibrate_flag_measures_caches_and_prints(measured, capsys):
    assert main(["--calibrate", "--devices", "4"]) == 0
    assert measured[0][3] == 4  # processes
    out = capsys.readouterr().out
    assert str(cache_path("gloo")) in out and "| all_reduce | 8 | 200 us | 2.00 GB/s | 4.00 KiB to 4.00 MiB (3) |" in out
    assert HostProfile.load(cache_path("gloo")) == synthetic_profile(processes=4)


def test_profile_flag_reads_a_file_the_host_cache_or_a_preset(measured, tmp_path):
    parse = build_parser().parse_args
    assert pricing(parse(["--devices", "4"])).hardware.name == "h100" and pricing(parse(["--devices", "4"])).profile is None
    assert pricing(parse(["--devices", "4", "--profile", "a100"])).hardware.name == "a100"
    path = synthetic_profile(host="elsewhere").save(tmp_path / "shared.json")
    chosen = pricing(parse(["--devices", "4", "--profile", str(path)]))
    assert chosen.profile.host == "elsewhere" and chosen.profile_path == path and chosen.hardware.name == "h100"
    assert pricing(parse(["--devices", "4", "--profile", "host"])).profile == synthetic_profile(processes=4)
    assert len(measured) == 1
    assert pricing(parse(["--devices", "4", "--profile", "host"])).profile_path == cache_path("gloo")
    assert len(measured) == 1, "cached: measured once"
    pricing(parse(["--devices", "4", "--refresh-profile"]))
    assert len(measured) == 2


def test_a_profile_measured_with_another_number_of_processes_is_measured_again(measured, capsys):
    parse = build_parser().parse_args
    assert pricing(parse(["--devices", "4", "--profile", "host"])).profile.processes == 4
    assert pricing(parse(["--devices", "8", "--profile", "host"])).profile.processes == 8 and len(measured) == 2
    assert "measured with 4 processes at once, this layout starts 8: measuring again" in capsys.readouterr().err
    assert pricing(parse(["--devices", "8", "--profile", "host"])).profile.processes == 8 and len(measured) == 2


@pytest.mark.parametrize(("argv", "match"), [
    (["--profile", "a100", "--hardware", "h100"], "names a preset, and `--hardware h100` was given too"),
    (["--profile", "nowhere.json"], "is neither a file nor a preset"),
    (["--profile", "a100", "--refresh-profile"], "names a preset, and `--refresh-profile` was given too"),
])
def test_profile_flags_refuse_a_contradiction(measured, capsys, argv, match):
    assert main(["--model", "examples.models.llama:Llama", "--devices", "2", *argv]) == 2
    assert match in capsys.readouterr().err and not measured


def test_refresh_profile_refuses_a_file(measured, tmp_path, capsys):
    path = synthetic_profile().save(tmp_path / "p.json")
    assert main(["--model", "examples.models.llama:Llama", "--devices", "2", "--profile", str(path),
                 "--refresh-profile"]) == 2
    assert "`--refresh-profile` measures this host" in capsys.readouterr().err


def test_a_dry_run_priced_with_a_profile_file_keeps_its_form_and_only_the_step_time_changes(tmp_path, capsys):
    path = synthetic_profile().save(tmp_path / "p.json")
    argv = ["--model", "examples.models.llama:Llama", "--devices", "2", "--layout", "tp=2", "--seq-len", "16", "--json"]
    assert main(argv) == 0
    preset = json.loads(capsys.readouterr().out)
    assert main([*argv, "--profile", str(path)]) == 0
    profiled = json.loads(capsys.readouterr().out)
    preset_time, profiled_time = preset["cost"].pop("step_time"), profiled["cost"].pop("step_time")
    assert profiled == preset and profiled_time.keys() == preset_time.keys()
    assert (preset_time["priced_by"], profiled_time["priced_by"]) == ("h100", f"profile of {synthetic_profile().host} (measured 2025-01-01)")
    assert profiled_time["total_s"] > 1000 * preset_time["total_s"] and profiled_time["link"] == {"tp": "measured"}


def test_a_dry_run_priced_by_a_profile_whose_ranks_outnumbered_its_cores_says_so(tmp_path, capsys):
    shared = synthetic_profile(processes=4, cores=2, utilization=((1e-3, 0.75),)).save(tmp_path / "shared.json")
    argv = ["--model", "examples.models.llama:Llama", "--devices", "4", "--layout", "pp=2,dp_shard=2", "--seq-len", "16",
            "--micro-batch", "4"]
    assert main([*argv, "--profile", str(shared)]) == 0
    out = capsys.readouterr().out
    assert "per rank over the 75% of the cores the ranks keep busy" in out and "is filled by the other ranks' work)" in out
    deep = [*argv[:5], "pp=4", "--seq-len", "16", "--micro-batch", "8"]  # 4 stages of 8 microbatches on 2 cores
    assert main([*deep, "--profile", str(shared)]) == 0
    assert "too few stages work to keep the cores busy: the stage's work x 1.062)." in capsys.readouterr().out
    assert main([*argv, "--profile", str(synthetic_profile().save(tmp_path / "alone.json"))]) == 0
    assert "over (1 - bubble" in capsys.readouterr().out
