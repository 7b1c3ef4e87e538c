"""Kineto's CPU events, for the synthetic traces of test_trace_analysis.py and test_trace_gpu.py."""

from __future__ import annotations


def op(name, ts, dur, tid=100, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 100, "tid": tid, "ts": ts, "dur": dur, "args": args}
