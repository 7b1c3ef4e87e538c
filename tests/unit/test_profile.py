"""`HostProfile`: its JSON file read back as written, a file it cannot read refused naming the fix, the cache file
named for the host, torch and backend, the latency/bandwidth fit, and the interpolations the step model reads."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from lightning_nd.cost import collective_fit
from lightning_nd.cost import profile as profile_module
from lightning_nd.cost.profile import SCHEMA, AttentionPoint, CollectiveFit, HostProfile, cache_path, cached_profile
from tests.unit.host_profiles import BYTES_PER_S, LATENCY_S, synthetic_profile


def test_json_round_trip(tmp_path):
    profile = synthetic_profile()
    path = profile.save(tmp_path / "deep" / "host.json")
    assert HostProfile.load(path) == profile
    record = json.loads(path.read_text())
    assert next(iter(record)) == "schema" and record["schema"] == SCHEMA
    assert record["collectives"][0]["samples"][0] == [2**12, pytest.approx(LATENCY_S + 2**12 / BYTES_PER_S)]
    assert len(path.read_text().splitlines()) > 20, "indented, for a person to read"


@pytest.mark.parametrize(("text", "match"), [
    ("{not json", "is not a readable profile"),
    (json.dumps({"schema": 0, "host": "old"}), f"is a profile of schema 0, this version reads schema {SCHEMA}"),
    (json.dumps([1, 2]), "is a profile of schema None"),
    (json.dumps({"schema": SCHEMA, "host": "x"}), "is not a valid profile"),
])
def test_load_refuses_what_it_cannot_read_naming_the_file_and_the_fix(tmp_path, text, match):
    path = tmp_path / "profile.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as refused:
        HostProfile.load(path)
    assert str(path) in str(refused.value) and "python -m lightning_nd.plan --calibrate" in str(refused.value)


def test_load_refuses_a_profile_with_a_non_positive_number(tmp_path):
    record = synthetic_profile().to_dict()
    record["memory_bytes_per_s"] = -1.0
    (tmp_path / "bad.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="every time and throughput positive and finite"):
        HostProfile.load(tmp_path / "bad.json")


def test_the_busy_share_is_interpolated_in_the_work_between_calls_and_one_where_the_cores_were_enough(tmp_path):
    measured = synthetic_profile(processes=4, cores=2, utilization=((1e-3, 0.6), (11e-3, 0.9)))
    assert measured.oversubscribed and HostProfile.load(measured.save(tmp_path / "p.json")) == measured
    assert measured.busy_share(0.0) == measured.busy_share(1e-3) == 0.6  # the nearest point outside
    assert measured.busy_share(6e-3) == pytest.approx(0.75) and measured.busy_share(1.0) == 0.9
    for enough in (dataclasses.replace(measured, cores=4), dataclasses.replace(measured, cores=0),
                   dataclasses.replace(measured, utilization=())):
        assert enough.busy_share(6e-3) == 1.0
    with pytest.raises(ValueError, match="share of the cores busy is at most 1"):
        dataclasses.replace(measured, utilization=((1e-3, 1.2),))


def test_cache_path_changes_with_host_torch_and_backend(monkeypatch, tmp_path):
    monkeypatch.delenv("LIGHTNING_ND_PROFILE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(profile_module.socket, "gethostname", lambda: "node-a")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    first = cache_path("gloo")
    assert first == tmp_path / "xdg" / "lightning_nd" / "profiles" / "node-a-torch2.13.0_cpu-gloo.json"
    assert cache_path("nccl") != first
    monkeypatch.setattr(torch, "__version__", "2.14.0+cpu")
    assert cache_path("gloo") not in (first, cache_path("nccl"))
    monkeypatch.setattr(profile_module.socket, "gethostname", lambda: "node-b")
    assert cache_path("gloo").name == "node-b-torch2.14.0_cpu-gloo.json"
    monkeypatch.setenv("LIGHTNING_ND_PROFILE_DIR", str(tmp_path / "mine"))
    assert cache_path("gloo").parent == tmp_path / "mine"


def test_cached_profile_is_this_hosts_or_none(monkeypatch, tmp_path):
    monkeypatch.setenv("LIGHTNING_ND_PROFILE_DIR", str(tmp_path))
    assert cached_profile("gloo") is None
    synthetic_profile().save(cache_path("gloo"))
    assert cached_profile("gloo") == synthetic_profile()
    synthetic_profile(torch="2.0.0").save(cache_path("gloo"))  # a file another torch wrote under this name
    assert cached_profile("gloo") is None
    record = synthetic_profile().to_dict()
    cache_path("gloo").write_text(json.dumps({**record, "schema": SCHEMA - 1}))  # an older version measured less
    assert cached_profile("gloo") is None


def test_the_fit_recovers_latency_and_bandwidth():
    sizes = [2**10, 2**14, 2**18, 2**22, 2**24]
    fit = CollectiveFit.fit("all_reduce", 4, [(n, 80e-6 + n / 3e9) for n in reversed(sizes)])
    assert fit.latency_s == pytest.approx(80e-6, rel=1e-9) and fit.bytes_per_s == pytest.approx(3e9, rel=1e-9)
    assert [size for size, _ in fit.samples] == sizes
    noisy = CollectiveFit.fit("all_reduce", 4, [(n, (80e-6 + n / 3e9) * (1.05 if i % 2 else 0.95))
                                                for i, n in enumerate(sizes)])
    assert noisy.latency_s == pytest.approx(80e-6, rel=0.1) and noisy.bytes_per_s == pytest.approx(3e9, rel=0.1)


def test_the_fit_stays_positive_and_finite():
    flat = CollectiveFit.fit("broadcast", 2, [(2**12, 1e-3), (2**18, 1e-3), (2**22, 0.9e-3)])
    assert flat.bytes_per_s == 1 / collective_fit.LONGEST_LINK_S_PER_BYTE and flat.latency_s == pytest.approx(
        0.97e-3, rel=0.05)
    steep = CollectiveFit.fit("broadcast", 2, [(2**12, 1e-9), (2**18, 1e-4), (2**22, 2e-3)])
    assert steep.latency_s == collective_fit.SHORTEST_LATENCY_S and 0 < steep.bytes_per_s < math.inf
    with pytest.raises(ValueError, match="at least 3 distinct message sizes"):
        CollectiveFit.fit("broadcast", 2, [(2**12, 1e-3), (2**12, 1e-3), (2**22, 2e-3)])


def test_matmul_seconds_interpolates_monotonically_between_measured_shapes():
    profile = synthetic_profile()
    for point in profile.matmul:
        assert profile.matmul_seconds(point.m, point.n, point.k, "float32") == pytest.approx(
            point.flops / point.flops_per_s)
    sizes = [2**i for i in range(4, 14)]
    times = [profile.matmul_seconds(n, n, n, "float32") for n in sizes]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert profile.matmul_seconds(8192, 8192, 8192, "float32") == pytest.approx(2 * 8192**3 / 5e10)  # beyond: 50 GF/s
    between = profile.matmul_seconds(128, 128, 128, "float32")
    assert 2 * 128**3 / 1e10 < between < 2 * 128**3 / 1e9


def test_matmul_seconds_never_prices_a_larger_matmul_faster():
    profile = synthetic_profile(matmul=tuple(p if p.m != 256 else type(p)(256, 256, 256, "float32", 1e12)
                                             for p in synthetic_profile().matmul))  # 256^3 measured oddly fast
    times = [profile.matmul_seconds(n, n, n, "float32") for n in range(32, 2048, 32)]
    assert times == sorted(times)
    with pytest.raises(ValueError, match=r"measured no `bfloat16` matmul, only \['float32'\]"):
        profile.matmul_seconds(64, 64, 64, "bfloat16")


def test_collective_and_memory_seconds():
    profile = synthetic_profile()
    assert profile.collective_seconds("all_gather", 2, 2**20) == pytest.approx(LATENCY_S + 2**20 / BYTES_PER_S)
    assert profile.collective_seconds("all_gather", 3, 0) == pytest.approx(LATENCY_S)  # nearest measured: 2
    assert profile.collective_seconds("all_gather", 5, 0) == pytest.approx(4 * LATENCY_S)  # a tie: the larger, 8
    assert profile.collective_seconds("all_gather", 64, 0) == pytest.approx(4 * LATENCY_S)
    assert profile.collective_seconds("send_recv", 1, 2**30) == 0.0
    assert profile.memory_seconds(5e9) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="Unknown collective `allreduce`"):
        profile.collective_seconds("allreduce", 2, 1)
    with pytest.raises(ValueError, match="calibrate with at least 2 processes"):
        synthetic_profile(collectives=(), processes=1).collective_seconds("all_reduce", 2, 1)


def test_the_in_step_latency_is_interpolated_in_the_work_between_calls_never_below_the_started_together_one():
    fit = CollectiveFit("all_reduce", 4, 1e-3, 1e9, ((4096, 1e-3), (2**20, 2e-3), (2**22, 5e-3)),
                        ((1e-3, 2e-3), (10e-3, 8e-3)))
    assert fit.in_step_latency(0.0) == fit.in_step_latency(1e-3) == 2e-3  # the nearest point outside
    assert fit.in_step_latency(5.5e-3) == pytest.approx(5e-3)
    assert fit.in_step_latency(1.0) == 8e-3
    assert fit.seconds(1e6) == pytest.approx(1e-3 + 1e-3) and fit.seconds(1e6, 5.5e-3) == pytest.approx(5e-3 + 1e-3)
    faster = CollectiveFit("all_reduce", 4, 1e-3, 1e9, fit.samples, ((1e-3, 1e-4),))
    assert faster.in_step_latency(3e-3) == 1e-3
    assert CollectiveFit("all_reduce", 4, 1e-3, 1e9, fit.samples).in_step_latency(3e-3) == 1e-3  # none measured
    profile = synthetic_profile(collectives=(fit,))
    assert profile.collective_seconds("all_reduce", 4, 0, work_s=5.5e-3) == pytest.approx(5e-3)
    assert HostProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


def test_attention_is_a_fixed_cost_per_query_row_plus_one_per_key_and_channel_fitted_to_the_points():
    row, per_key_channel = 0.3e-6, 0.25e-9
    points = tuple(AttentionPoint(heads, seq, size, heads * seq * (row + per_key_channel * seq * size))
                   for heads, seq, size in ((64, 32, 8), (8, 256, 64), (16, 128, 16)))
    profile = synthetic_profile(attention=points)
    assert profile.attention_seconds(32, 64, 16) == pytest.approx(32 * 64 * (row + per_key_channel * 64 * 16))
    assert synthetic_profile().attention_seconds(32, 64, 16) is None and synthetic_profile(
        attention=points[:1]).attention_seconds(32, 64, 16) is None
    flat = synthetic_profile(attention=(AttentionPoint(8, 32, 8, 1e-3), AttentionPoint(8, 64, 8, 1e-3)))
    assert flat.attention_seconds(8, 32, 8) >= 0 and flat.attention_seconds(8, 64, 8) >= 0  # kept positive
    assert HostProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
