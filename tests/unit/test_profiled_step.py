"""`profiled_step_time`: a step priced by a measured host profile, term by term against sums worked out here from the
profile's own numbers; and the planner labels what priced its tables."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_nd.cost.comm import comm_per_step
from lightning_nd.cost.layout_cost import cost_layout
from lightning_nd.cost.op_count import OpCount, count_model_ops
from lightning_nd.cost.profile import AttentionPoint
from lightning_nd.cost.profiled_step import profiled_step_time, shared_core_fill
from lightning_nd.cost.shape import model_shape
from lightning_nd.planner.dry_run import dry_run
from tests.unit.host_profiles import BYTES_PER_S, synthetic_profile
from tests.unit.test_cost_comm import DENSE, MOE, WORKLOAD

PROFILE = synthetic_profile(framework=(), adam_tensor_s=None)
"""Without the frameworks' measured overheads: each term below alone."""
MEASURED = synthetic_profile()


def _step(sizes: dict, profile=PROFILE, ops=None, options: dict | None = None):
    layout = dry_run(DENSE, 8 if sizes.get("pp", 1) > 1 or sizes.get("tp", 1) > 2 else 2, sizes, options or {})
    return layout, profiled_step_time(layout, model_shape(DENSE.model), WORKLOAD, profile, ops)


@pytest.mark.parametrize("sizes", [{"dp_shard": 2}, {"tp": 2}, {"dp_shard": 2, "tp": 4}])
def test_each_collective_call_costs_the_profiles_latency(sizes):
    """More latency per call adds exactly calls x the difference to that dim's time."""
    slower = dataclasses.replace(PROFILE, collectives=tuple(
        dataclasses.replace(fit, latency_s=fit.latency_s + 1e-3) for fit in PROFILE.collectives))
    layout, base = _step(sizes)
    _, late = _step(sizes, slower)
    for dim, traffic in comm_per_step(layout, model_shape(DENSE.model), WORKLOAD).items():
        calls = sum(c.count for c in traffic.calls)
        assert calls > 0 and late.comm_s[dim] - base.comm_s[dim] == pytest.approx(calls * 1e-3, rel=1e-9), dim


def test_tp_calls_are_one_all_reduce_per_row_parallel_layer_forward_and_backward_plus_embedding_and_head():
    layout, _ = _step({"tp": 2})
    calls = comm_per_step(layout, model_shape(DENSE.model), WORKLOAD)["tp"].calls
    all_reduces = [c for c in calls if c.kind == "all_reduce"]
    assert sum(c.count for c in all_reduces) == 2 * 2 * 4 + 2  # 2 row-parallel layers x 4 blocks, fwd + bwd


def test_eager_overhead_is_the_counted_operations_times_the_profiles_time_per_operation():
    ops = count_model_ops(DENSE)  # a meta-device model counts too
    assert ops is not None
    _, step = _step({"dp_shard": 2}, ops=ops)
    _, doubled = _step({"dp_shard": 2}, dataclasses.replace(PROFILE, op_overhead_s=2 * PROFILE.op_overhead_s), ops)
    assert step.overhead_s == pytest.approx(PROFILE.op_overhead_s * ops.total)
    assert doubled.total_s - step.total_s == pytest.approx(step.overhead_s)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_parallelism_runs_a_ranks_share_of_the_operations_inside_the_experts(ep):
    ops = OpCount(per_block=(700,) * 4, outside=30, expert_ops=(400,) * 4)
    layout = dry_run(MOE, 8, {"dp_shard": 8, "ep": ep}, {})
    step = profiled_step_time(layout, model_shape(MOE.model), WORKLOAD, PROFILE, ops)
    assert step.overhead_s == pytest.approx(PROFILE.op_overhead_s * ((700 - 400 * (ep - 1) // ep) * 4 + 30))


def test_under_ep_each_blocks_experts_are_an_fsdp_unit_over_the_ranks_holding_the_same_experts():
    """ep=2 of 4 batch ranks: the experts of each of the 4 blocks are a unit over 2 ranks (expert_dp); ep=4: each
    rank holds its experts whole, no such unit. The difference is those units and the 100 operations per block ep=4
    runs fewer (a quarter of the 400 inside the experts against a half)."""
    ops = OpCount(per_block=(700,) * 4, outside=30, expert_ops=(400,) * 4)
    two_d = dataclasses.replace(MEASURED, framework=tuple(
        dataclasses.replace(p, fsdp_tp_unit_s=p.fsdp_unit_s + 3e-3) for p in MEASURED.framework))
    unit = MEASURED.framework_at(2)
    assert unit is not None
    for profile, expert_unit in ((MEASURED, unit.fsdp_unit_s), (two_d, unit.fsdp_unit_s + 3e-3)):
        steps = {}
        for ep in (2, 4):
            layout = dry_run(MOE, 4, {"dp_shard": 4, "ep": ep}, {})
            steps[ep] = profiled_step_time(layout, model_shape(MOE.model), WORKLOAD, profile, ops)
            assert ("expert_dp" in comm_per_step(layout, model_shape(MOE.model), WORKLOAD)) == (ep == 2)
        # the experts are DTensors over ep: their unit is the measured 2-D one where there is one
        assert steps[2].overhead_s - steps[4].overhead_s == pytest.approx(
            4 * expert_unit + 100 * 4 * MEASURED.op_overhead_s)


def test_the_frameworks_measured_overheads_are_priced_per_fsdp_unit_tp_layer_and_parameter_tensor():
    ops = count_model_ops(DENSE)
    layout, bare = _step({"dp_shard": 2}, ops=ops)
    _, measured = _step({"dp_shard": 2}, MEASURED, ops)
    units = 4 + 1  # four blocks and the root, each an FSDP unit
    assert measured.overhead_s - bare.overhead_s == pytest.approx(units * MEASURED.framework_at(2).fsdp_unit_s)
    tensors = len(layout.rank(0).params)
    fsdp_latency = sum(c.count * PROFILE.collective_seconds(c.kind, 2, 0)
                       for c in comm_per_step(layout, model_shape(DENSE.model), WORKLOAD)["fsdp"].calls)
    assert measured.comm_s["fsdp"] == pytest.approx(bare.comm_s["fsdp"] - fsdp_latency)  # inside the unit's time
    assert (measured.compute_s - measured.overhead_s) - (bare.compute_s - bare.overhead_s) == pytest.approx(
        tensors * MEASURED.framework_at(2).dtensor_adam_s)
    layout, bare = _step({"tp": 2}, ops=ops)
    _, measured = _step({"tp": 2}, MEASURED, ops)
    split = [p for p in layout.rank(0).params if "tp:" in p.placement and len(p.shape) == 2]
    assert len(split) == 4 * 7 + 2  # q, k, v, o, gate, up and down of each block, the embedding and the head
    pairs, extra = 4 * 2 + 1, 4 * 3  # o and down close a pair each, the embedding one; q, k, v, gate, up: 3 over
    point = MEASURED.framework_at(2)
    assert measured.overhead_s - bare.overhead_s == pytest.approx(pairs * point.tp_pair_s + extra * 3 * point.dtensor_op_s)
    tp_latency = sum(c.count * PROFILE.collective_seconds(c.kind, 2, 0)
                     for c in comm_per_step(layout, model_shape(DENSE.model), WORKLOAD)["tp"].calls)
    assert measured.comm_s["tp"] == pytest.approx(bare.comm_s["tp"] - tp_latency)


def test_a_pipeline_divides_its_stage_by_one_minus_the_bubble():
    _, step = _step({"pp": 2, "dp_shard": 4})
    assert 0 < step.bubble_fraction < 1
    assert step.total_s > step.compute_s and step.priced_by.startswith("profile of ")


@pytest.mark.parametrize(("sizes", "options", "cores", "fill"), [
    ({"dp_shard": 2}, {}, 2, 1.0), ({"tp": 2}, {}, 2, 1.0), ({"pp": 2, "dp_shard": 4}, {"pp_microbatches": 8}, 2, 1.0),
    ({"pp": 4, "dp_shard": 2}, {"pp_microbatches": 4}, 6, 44 / 32)])
def test_where_the_ranks_outnumber_the_cores_the_step_is_their_work_over_the_busy_share_and_the_idle_fill(
        sizes, options, cores, fill):
    """The stage's work x how long the pipeline's fill and drain keep cores idle, plus the once-per-step work, over
    the busy share. 2 stages beside 4 batch ranks keep 2 cores busy in every slot: no bubble left. 4 stages of 4
    microbatches beside 2 batch ranks on 6 cores: 2, 4, 6, 8, 6, 4, 2 ranks work in the 7 slots, each at least 6
    cores' time: 44 / (8 ranks x 4 microbatches)."""
    alone = dataclasses.replace(MEASURED, processes=8, cores=8, utilization=((1e-3, 0.8),))
    shared = dataclasses.replace(alone, cores=cores)
    layout, step = _step(sizes, alone, options=options)
    _, busy = _step(sizes, shared, options=options)
    assert step.busy_share == 1.0 and busy.busy_share == 0.8
    once = sum(step.comm_s.get(dim, 0.0) for dim in ("pp", "loss"))  # the exchanges and the loss: once per step
    work, bubble = step.compute_s + sum(step.comm_s.values()) - once, step.bubble_fraction  # stage work + optimizer
    # alone, total = (work - optimizer) / (1 - bubble) + once + optimizer: the optimizer, which is outside the stage
    optimizer = (work / (1 - bubble) + once - step.total_s) * (1 - bubble) / bubble if bubble else 0.0
    assert busy.total_s == pytest.approx(((work - optimizer) * fill + once + optimizer) / 0.8)
    if layout.dims["pp"] == 1:
        assert busy.total_s == pytest.approx(step.total_s / 0.8)
    else:
        assert step.bubble_fraction > 0 and busy.total_s < step.total_s / 0.8  # less than the whole bubble


def test_the_idle_fill_counts_the_ranks_with_work_in_each_slot():
    assert shared_core_fill(4, 4, 4, 2) == pytest.approx(18 / 16)  # 1, 2, 3, 4, 3, 2, 1 stages working
    assert shared_core_fill(4, 8, 4, 2) == pytest.approx(34 / 32)
    assert shared_core_fill(2, 2, 4, 2) == 1.0  # 2, 4, 2 ranks: the 2 cores busy throughout
    assert shared_core_fill(4, 4, 4, 4) == pytest.approx(28 / 16)  # a core each: the whole bubble, 1 / (1 - 3/7)


def test_cost_layout_prices_with_the_profile_when_one_is_given():
    layout = dry_run(DENSE, 2, {"dp_shard": 2}, {})
    priced = cost_layout(layout, model_shape(DENSE.model), WORKLOAD, profile=PROFILE).time
    preset = cost_layout(layout, model_shape(DENSE.model), WORKLOAD, hardware=None)
    assert priced is not None and priced.priced_by == f"profile of {PROFILE.host} (measured 2025-01-01)" and preset.time is None


def _in_step(profile, latency_at_no_work: float):
    """Every collective's latency inside a step = ``latency_at_no_work`` + the work between calls."""
    return dataclasses.replace(profile, collectives=tuple(
        dataclasses.replace(fit, in_step=((0.0, latency_at_no_work), (1.0, latency_at_no_work + 1.0)))
        for fit in profile.collectives))


def test_a_call_inside_a_step_waits_as_measured_after_the_ranks_work_between_calls():
    """The logged loss's all-reduce gives the work between calls; cp's exchanges each wait the in-step latency at it,
    FSDP's (inside its measured unit) only the wait it adds beyond the latency after no work."""
    ops = count_model_ops(DENSE)
    profile = _in_step(MEASURED, 2e-3)
    layout, step = _step({"cp": 2}, profile, ops)
    loss = step.comm_s["loss"]
    gap = loss - 2e-3 - 4 / BYTES_PER_S
    assert gap > 0
    traffic = comm_per_step(layout, model_shape(DENSE.model), WORKLOAD)
    calls = sum(c.count for t in traffic.values() for c in t.calls) + 1
    assert step.comm_s["cp"] == pytest.approx(sum(c.count * (2e-3 + gap + c.buffer_bytes / BYTES_PER_S)
                                                  for c in traffic["cp"].calls))
    assert step.comm_s["fsdp"] == pytest.approx(sum(c.count * (gap + c.buffer_bytes / BYTES_PER_S)
                                                    for c in traffic["fsdp"].calls))
    assert calls > 2
    _, alone = _step({"tp": 2}, profile, ops)
    assert "loss" not in alone.comm_s  # one batch rank: no average to take


def test_measured_attention_prices_each_block_once_per_ring_hop():
    points = (AttentionPoint(64, 32, 8, 2e-3), AttentionPoint(8, 256, 64, 2e-2))
    slower = (AttentionPoint(64, 32, 8, 4e-3), AttentionPoint(8, 256, 64, 4e-2))
    for cp in (1, 2):
        _, once = _step({"dp_shard": 2 // cp, "cp": cp}, synthetic_profile(attention=points))
        _, twice = _step({"dp_shard": 2 // cp, "cp": cp}, synthetic_profile(attention=slower))
        shape = model_shape(DENSE.model)
        attention = synthetic_profile(attention=points).attention_seconds(
            WORKLOAD.batch * shape.heads, WORKLOAD.seq_len // cp, shape.head_dim)
        assert twice.compute_s - once.compute_s == pytest.approx(shape.layers * cp * attention)


def test_a_pipeline_pays_its_measured_cost_per_microbatch():
    ops = count_model_ops(DENSE)
    options = {"pp_microbatches": 4}
    _, bare = _step({"pp": 2, "dp_shard": 4}, MEASURED, ops, options)
    points = tuple(dataclasses.replace(p, pp_microbatch_s=3e-3) for p in MEASURED.framework)
    _, priced = _step({"pp": 2, "dp_shard": 4}, dataclasses.replace(MEASURED, framework=points), ops, options)
    assert priced.overhead_s - bare.overhead_s == pytest.approx(4 * 3e-3)
    assert "pp" in priced.comm_s and priced.comm_s["pp"] < bare.comm_s["pp"]  # its exchanges' latency is inside


def test_counted_bytes_price_the_memory_bound_operations():
    ops = count_model_ops(DENSE)
    assert ops is not None and ops.bytes_per_token
    doubled = dataclasses.replace(ops, bytes_per_token=tuple(2 * b for b in ops.bytes_per_token),
                                  outside_bytes_per_token=2 * ops.outside_bytes_per_token)
    _, step = _step({"dp_shard": 2}, PROFILE, ops)
    _, more = _step({"dp_shard": 2}, PROFILE, doubled)
    tokens = WORKLOAD.batch * WORKLOAD.seq_len
    moved = tokens * (sum(ops.bytes_per_token) + ops.outside_bytes_per_token)
    assert more.compute_s - step.compute_s == pytest.approx(PROFILE.memory_seconds(moved))


def test_sequence_parallelism_prices_each_pair_as_the_measured_sequence_parallel_block():
    ops = count_model_ops(DENSE)
    points = tuple(dataclasses.replace(p, tp_sp_pair_s=p.tp_pair_s + 5e-3) for p in MEASURED.framework)
    profile = dataclasses.replace(MEASURED, framework=points)
    _, plain = _step({"tp": 2}, profile, ops, {"sequence_parallel": False})
    _, sequence = _step({"tp": 2}, profile, ops, {"sequence_parallel": True})
    pairs = 4 * 2 + 1  # o and down in each of 4 blocks, the embedding
    assert sequence.overhead_s - plain.overhead_s == pytest.approx(pairs * 5e-3)
    _, unmeasured = _step({"tp": 2}, MEASURED, ops, {"sequence_parallel": True})
    assert unmeasured.overhead_s == pytest.approx(plain.overhead_s)  # the plain pair's price where not measured


def test_fsdp_over_tensor_parallel_parameters_pays_the_measured_two_d_unit_where_there_is_one():
    """dp_shard=2 x tp=2: each of the 5 FSDP units (4 blocks and the root) at the 2-D unit's price; without tp, or
    where the calibration's world held no 2-D mesh (0), the plain unit's."""
    ops = count_model_ops(DENSE)
    points = tuple(dataclasses.replace(p, fsdp_tp_unit_s=p.fsdp_unit_s + 4e-3) for p in MEASURED.framework)
    profile = dataclasses.replace(MEASURED, framework=points)
    layout = dry_run(DENSE, 4, {"dp_shard": 2, "tp": 2}, {})
    plain, two_d = (profiled_step_time(layout, model_shape(DENSE.model), WORKLOAD, p, ops) for p in (MEASURED, profile))
    assert two_d.overhead_s - plain.overhead_s == pytest.approx(5 * 4e-3)
    _, alone = _step({"dp_shard": 2}, MEASURED, ops)
    _, alone_two_d = _step({"dp_shard": 2}, profile, ops)
    assert alone_two_d.overhead_s == pytest.approx(alone.overhead_s)
