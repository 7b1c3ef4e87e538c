"""What prices the planner's tables: a datasheet preset (``--hardware h100``, or ``--profile h100``) or a measured
`HostProfile` (``--profile my_host.json``, or ``--profile host`` for this host's cached one, measured on first use);
and ``--calibrate``, which measures this host now, caches its profile and prints it.

    python -m lightning_nd.plan --calibrate [--devices 4]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from lightning_nd.cost.calibrate import host_profile
from lightning_nd.cost.hardware import PRESETS, Hardware, parse_hardware
from lightning_nd.cost.profile import HostProfile
from lightning_nd.layout.describe import human_bytes

HOST = "host"
"""``--profile host``: this host's cached profile."""
DEFAULT_HARDWARE = "h100"


@dataclass(frozen=True)
class Pricing:
    """The planner's prices: the datasheet preset the step model reads, and the measured profile, if one was
    chosen."""

    hardware: Hardware
    profile: HostProfile | None = None
    profile_path: Path | None = None


def priced_by(priced: Pricing) -> str:
    """What prices the tables, as their headers say it: the datasheet preset by name, or the profile's host, file and
    age."""
    if priced.profile is None:
        return f"the {priced.hardware.name} datasheet preset"
    return f"the profile of {priced.profile.host} ({priced.profile_path}, measured {priced.profile.created})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calibrate", action="store_true", help="measure this host now (at most 30 s), cache its"
                        " profile, print where and what it measured, and exit; with --devices N: measured with N"
                        " processes at once (default: the GPUs, else 4)")
    parser.add_argument("--profile", help=f"price with a measured profile: a JSON file, `{HOST}` (this host's, measured"
                        f" on first use and cached), or a preset ({', '.join(PRESETS)}) as --hardware takes it")
    parser.add_argument("--refresh-profile", action="store_true", help=f"measure this host again first (implies"
                        f" --profile {HOST})")


def pricing(args: argparse.Namespace) -> Pricing:
    """The preset and the profile ``--hardware``, ``--profile`` and ``--refresh-profile`` choose; without them the
    ``h100`` preset alone, as before profiles existed."""
    chosen = args.profile or (HOST if args.refresh_profile else None)
    if chosen is None:
        return Pricing(parse_hardware(args.hardware or DEFAULT_HARDWARE))
    if is_preset(chosen) and (args.hardware or args.refresh_profile):
        given = f"--hardware {args.hardware}" if args.hardware else "--refresh-profile"
        raise ValueError(f"`--profile {chosen}` names a preset, and `{given}` was given too. HINT: pass the"
                         " preset once, as `--hardware` or as `--profile`.")
    if args.refresh_profile and chosen != HOST:
        raise ValueError(f"`--refresh-profile` measures this host, `--profile {chosen}` reads a file. HINT: drop one,"
                         f" or pass `--profile {HOST} --refresh-profile`.")
    return choose_pricing(chosen, _processes(args), hardware=args.hardware, refresh=args.refresh_profile)


def is_preset(chosen: str) -> bool:
    return chosen.split(",")[0].strip().lower() in PRESETS


def choose_pricing(chosen: str, processes: int | None, *, hardware: str | None = None, refresh: bool = False,
                   knob: str = "--profile ") -> Pricing:
    """``chosen``: a preset, `host` (this host's cached profile, measured first with ``processes`` at once when
    there is none or ``refresh``) or a profile file; ``knob`` is how errors name what chose it."""
    if is_preset(chosen):
        return Pricing(parse_hardware(chosen))
    if chosen == HOST:
        profile, path = host_profile(refresh=refresh, processes=processes)
    else:
        path = Path(chosen)
        if not path.is_file():
            raise ValueError(f"`{knob}{chosen}` is neither a file nor a preset. HINT: pass a profile written by"
                             f" `--calibrate`, `{HOST}`, or one of {', '.join(PRESETS)}.")
        profile = HostProfile.load(path)
    return Pricing(parse_hardware(hardware or DEFAULT_HARDWARE), profile, path)


def calibrate_command(args: argparse.Namespace) -> int:
    """``--calibrate``: measure, cache, print the profile's file and a summary."""
    profile, path = host_profile(refresh=True, processes=_processes(args))
    print(profile_markdown(profile, path))
    return 0


def _processes(args: argparse.Namespace) -> int | None:
    """Processes a layout starts on this host: ``--devices``, at most ``--gpus-per-node``; None for the default."""
    if args.devices is None:
        return None
    return min(args.devices, args.gpus_per_node or args.devices)


def profile_markdown(profile: HostProfile, path: Path) -> str:
    """The profile in a few lines: where it is, what ran, and each measured number."""
    lines = [(f"# Profile of `{profile.host}`: {profile.device}, {profile.processes} processes at once, torch"
              f" {profile.torch}, {profile.backend}"), "",
             f"Measured in {profile.calibration_s:.1f} s at {profile.created}; saved to `{path}`.", "",
             "| what | per process |", "|---|---|",
             f"| one operation of a training forward and backward (autograd included) | {profile.op_overhead_s * 1e6:.1f} us |",
             f"| memory-bound add (bytes read + written) | {profile.memory_bytes_per_s / 1e9:.2f} GB/s |"]
    lines += [f"| matmul {p.m}x{p.n}x{p.k} {p.dtype} | {p.flops_per_s / 1e9:.1f} GFLOP/s |" for p in profile.matmul]
    lines += [f"| attention {a.batch_heads} heads x {a.seq} tokens x {a.head_dim}, forward + backward |"
              f" {a.seconds * 1e3:.2f} ms |" for a in profile.attention]
    if profile.adam_tensor_s is not None:
        lines += [f"| AdamW update of one plain parameter | {profile.adam_tensor_s * 1e6:.0f} us |"]
    if profile.framework:
        lines += ["", "| ranks | FSDP unit, forward + backward | tp linear pair, forward + backward | the same, sequence"
                  " parallel, with a norm and a residual add | DTensor op + its backward | AdamW, one DTensor parameter"
                  " | pipeline, one microbatch more | FSDP unit over tp=2 parameters |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {p.group_size} | {p.fsdp_unit_s * 1e3:.2f} ms | {p.tp_pair_s * 1e3:.2f} ms |"
                  f" {p.tp_sp_pair_s * 1e3:.2f} ms |"
                  f" {p.dtensor_op_s * 1e6:.0f} us | {p.dtensor_adam_s * 1e6:.0f} us |"
                  f" {f'{p.pp_microbatch_s * 1e3:.2f} ms' if p.group_size > 1 else '-'} |"
                  f" {f'{p.fsdp_tp_unit_s * 1e3:.2f} ms' if p.fsdp_tp_unit_s else '-'} |" for p in profile.framework]
    if profile.collectives:
        works = sorted({round(w * 1e3, 1) for c in profile.collectives for w, _ in c.in_step})
        lines += ["", "| collective | ranks | latency | bandwidth | sizes measured |"
                  + "".join(f" in a step, after {w} ms of work |" for w in works), "|---|---|---|---|---|" + "---|" * len(works)]
        lines += [f"| {c.kind} | {c.group_size} | {c.latency_s * 1e6:.0f} us | {c.bytes_per_s / 1e9:.2f} GB/s |"
                  f" {human_bytes(c.samples[0][0])} to {human_bytes(c.samples[-1][0])} ({len(c.samples)}) |"
                  + "".join(f" {t * 1e6:.0f} us |" for _, t in c.in_step) for c in profile.collectives]
    if profile.utilization:
        busy = ", ".join(f"{share:.0%} after {work * 1e3:.1f} ms of work between calls" for work, share in
                         profile.utilization)
        lines += ["", f"Share of the {profile.cores} cores the {profile.processes} processes kept busy through those"
                  f" loops: {busy}" + ("" if profile.oversubscribed else " (as many cores as processes: not used)")
                  + "."]
    return "\n".join(lines)
