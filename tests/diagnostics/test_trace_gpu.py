"""Profiler traces -> each step's parts on a GPU (`diagnostics/analysis/trace_gpu.py`), on synthetic NCCL traces
in Kineto's format: a collective's time counted only where no kernel hides it, the idle device counted as host,
each collective's role from our label, its process group or the FSDP region around its launch; NCCL inside the
pipeline: pp's send / recv idle, ours by its label."""

from __future__ import annotations

import pytest

from diagnostics.analysis.trace import rank_times, trace_steps
from tests.diagnostics.trace_cases import op


def _launch(ts, correlation, tid=100, name="cudaLaunchKernel"):
    return op(name, ts, 2, tid=tid, cat="cuda_runtime", correlation=correlation, cbid=211)


def _kernel(name, ts, dur, correlation, stream=7, cat="kernel", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": correlation, "device": 0, "stream": stream, **args}}


def _gpu_trace() -> dict:
    group = "Process Group Description"
    events = [
        op("ProfilerStep#7", 0, 1000, cat="user_annotation"),
        op("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 10, 90, cat="user_annotation"),
        _launch(15, 7, name="cudaMemcpyAsync"),
        op("nd::phase::forward", 100, 400, cat="user_annotation"),
        op("aten::mm", 110, 40), _launch(120, 1),
        op("c10d::allreduce_", 200, 40), op("record_param_comms", 205, 30, **{group: "mesh_tp"}), _launch(210, 2),
        op("aten::mm", 480, 15), _launch(490, 5),
        op("nd::phase::backward", 500, 400, cat="user_annotation"),
        # the autograd thread launches backward's kernels and FSDP's reduce-scatter over the default group
        op("autograd::engine::evaluate_function: MmBackward0", 510, 90, tid=101), _launch(520, 3, tid=101),
        op("FSDP::post_backward_reduce", 700, 60, tid=101, cat="user_annotation"),
        op("c10d::_reduce_scatter_base_", 705, 45, tid=101),
        op("record_param_comms", 706, 43, tid=101, **{group: "default_pg"}), _launch(710, 4, tid=101),
        _launch(850, 6),
        _kernel("Memcpy HtoD (Pageable -> Device)", 20, 40, 7, cat="gpu_memcpy"),
        _kernel("ampere_sgemm_128x64_nn", 150, 250, 1),
        _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 300, 150, 2, stream=13),
        _kernel("volta_sgemm_64x64_nn", 500, 60, 5),
        _kernel("elementwise_kernel", 600, 100, 3),
        _kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 720, 80, 4, stream=13),
        _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 850, 30, 6, stream=13, **{group: "mesh_dp_replicate"}),
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#7", "pid": 0, "tid": 7, "ts": 0, "dur": 990},
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 100, "tid": 100, "ts": 120},
    ]
    return {"schemaVersion": 1, "traceEvents": events,
            "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 4, "pg_config": [
                {"pg_name": "0", "pg_desc": "default_pg", "pg_size": 4, "ranks": [0, 1, 2, 3]},
                {"pg_name": "1", "pg_desc": "mesh_dp_replicate", "pg_size": 2, "ranks": [0, 2]},
                {"pg_name": "2", "pg_desc": "mesh_tp", "pg_size": 2, "ranks": [0, 1]}]}}


def test_gpu_trace_exposes_only_nccl_time_no_kernel_hides_and_counts_the_idle_device_as_host():
    (step,) = trace_steps(_gpu_trace())
    us = 1e-6
    assert step.step == 7 and step.step_s == pytest.approx(1000 * us)
    expected = {
        # [0,10] and [900,1000] idle; the loader's fetch minus the copy it launched
        "data_wait": {"host": 110 * us, "loader": 50 * us, "compute": 40 * us},
        # the all-reduce hides under the gemm for 100 us, exposed 50 (tp, from its process group); the GPU
        # idles 100 us; a kernel launched in forward runs [500, 560] while the CPU is in backward: forward's
        "forward": {"compute": 310 * us, "comm:tp": 50 * us, "host": 100 * us},
        # fsdp from the FSDP region around the launch (its group is the default one); dp_replicate from the
        # kernel's own args (no record_param_comms around its launch)
        "backward": {"compute": 100 * us, "comm:fsdp": 80 * us, "comm:dp_replicate": 30 * us, "host": 130 * us},
    }
    assert step.split.keys() == expected.keys()
    for region, parts in expected.items():
        assert step.split[region] == pytest.approx(parts, abs=1e-12), region
    times = rank_times([step], 0)
    assert times.phases["host"] == pytest.approx(380 * us) and times.phases["forward"] == pytest.approx(310 * us)
    assert times.comm == pytest.approx({"tp": 50 * us, "fsdp": 80 * us, "dp_replicate": 30 * us})
    assert abs(times.residual_s) < 1e-12


def test_gpu_trace_nccl_inside_the_pipeline_is_idle_for_pp_send_recv_and_ours_by_label():
    events = [
        op("ProfilerStep#1", 0, 100, cat="user_annotation"),
        op("nd::pipeline", 0, 100, cat="user_annotation"),
        op("c10d::recv_", 10, 5), _launch(11, 1),
        op("nd::comm::pp::tied_all_reduce", 50, 10, cat="user_annotation"), op("c10d::allreduce_", 51, 8),
        op("record_param_comms", 52, 6, **{"Process Group Description": "mesh_pp"}), _launch(53, 2),
        _kernel("ncclDevKernel_SendRecv", 20, 20, 1, stream=13),
        _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 60, 10, 2, stream=13),
    ]
    trace = {"traceEvents": events, "distributedInfo": {"rank": 0, "world_size": 2, "pg_config": [
        {"pg_desc": "mesh_pp", "pg_size": 2}]}}
    (step,) = trace_steps(trace)
    assert step.split == {"pipeline": pytest.approx({"pipeline_idle": 90e-6, "comm:pp": 10e-6})}
