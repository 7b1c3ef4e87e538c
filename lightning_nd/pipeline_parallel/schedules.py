"""Pipeline schedules by name, checked before any process group: how many stages a rank runs, how many
microbatches a batch splits into, and the bubble that leaves (pure arithmetic; torch's schedule classes are
looked up only by the runner, `pipeline_parallel/runner.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_nd.mesh.dims import closest_name

SINGLE_STAGE = ("gpipe", "1f1b")
LOOPED = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble")
V_SHAPED = ("zbv", "dualpipev")
SCHEDULES = SINGLE_STAGE + LOOPED + V_SHAPED
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv", "dualpipev")
"""Schedules that split a stage's backward into input and weight gradients. torch 2.13's weight step fails ("Trying to
backward through the graph a second time") for a parameter a stage uses twice (a tie inside one stage)."""


def check_schedule(schedule: str, pp: int, stages_per_rank: int | None, microbatches: int | None) -> tuple[int, int]:
    """Validate a schedule against the pipeline size; returns (stages per rank, microbatches) with defaults."""
    if schedule not in SCHEDULES:
        raise ValueError(f"`pp_schedule={schedule!r}` is not a schedule. HINT: did you mean"
                         f" {closest_name(str(schedule), SCHEDULES)!r}? Choose from {', '.join(SCHEDULES)}.")
    default = 1 if schedule in SINGLE_STAGE else 2
    stages_per_rank = default if stages_per_rank is None else stages_per_rank
    if schedule in SINGLE_STAGE and stages_per_rank != 1:
        raise ValueError(f"`pp_schedule={schedule!r}` runs one stage per rank, not {stages_per_rank}. HINT: use"
                         f" 'interleaved_1f1b' for {stages_per_rank} stages per rank, or pp_stages_per_rank=1.")
    if schedule in V_SHAPED and stages_per_rank != 2:
        raise ValueError(f"`pp_schedule={schedule!r}` is V-shaped: exactly 2 stages per rank. HINT: pp_stages_per_rank=2.")
    if schedule in LOOPED and stages_per_rank < 2:
        raise ValueError(f"`pp_schedule={schedule!r}` loops over several stages per rank. HINT: pp_stages_per_rank=2,"
                         " or the single-stage schedule '1f1b'.")
    microbatches = 2 * pp if microbatches is None else microbatches
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"`pp_microbatches={microbatches!r}` must be a positive integer. HINT: {2 * pp} (2 x pp).")
    num_stages = pp * stages_per_rank
    least = 1 if schedule == "gpipe" else (num_stages if schedule in ("1f1b", "dualpipev") else pp)
    if microbatches < least:
        raise ValueError(f"`pp_schedule={schedule!r}` with {num_stages} stages needs at least {least} microbatches,"
                         f" got pp_microbatches={microbatches}. HINT: pp_microbatches={max(least, 2 * pp)}.")
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and microbatches % max(1, microbatches // pp):
        raise ValueError(f"`pp_schedule={schedule!r}` runs microbatches in rounds of pp={pp}: pp_microbatches="
                         f"{microbatches} does not split into them. HINT: use a multiple of {pp}.")
    return stages_per_rank, microbatches


def check_microbatches(inputs: Mapping[str, Any], microbatches: int) -> None:
    """Every input's batch dim must split into ``microbatches`` equal microbatches."""
    sizes = {tuple(v.shape)[:1] for v in inputs.values() if isinstance(v, torch.Tensor)}
    for (size,) in sizes:
        if size % microbatches:
            raise ValueError(
                f"The batch has {size} samples per rank, which pp_microbatches={microbatches} does not divide."
                f" HINT: use a batch size that is a multiple of {microbatches}, or set pp_microbatches to one"
                " of its divisors (and `drop_last=True` for a short last training batch)."
            )


def chunks_per_rank(schedule: str, microbatches: int, stages_per_rank: int = 1) -> int:
    """What a rank's stages run through in a step: m microbatches, x v stages per rank where the schedule runs them."""
    return microbatches * (1 if schedule in SINGLE_STAGE else stages_per_rank)


def theoretical_bubble(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of a step: (p-1)/(m+p-1); with v stages per rank (p-1)/(v*m+p-1)."""
    return (pp - 1) / (chunks_per_rank(schedule, microbatches, stages_per_rank) + pp - 1)
