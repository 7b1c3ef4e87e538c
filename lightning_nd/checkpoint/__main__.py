"""Inspect, verify and export lightning-nd checkpoints without starting any process group.

    python -m lightning_nd.checkpoint export CKPT OUT [--format torch|safetensors] [--module model]
    python -m lightning_nd.checkpoint verify CKPT
    python -m lightning_nd.checkpoint latest DIR

A checkpoint that cannot be read (incomplete, damaged, crafted, another model's) ends in one line naming the file and
what is wrong, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_nd.checkpoint.export import export
from lightning_nd.checkpoint.files import CheckpointError, problems, read_manifest
from lightning_nd.checkpoint.listing import latest_checkpoint


def _progress(message: str) -> None:
    print(f"[lightning_nd.checkpoint] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_nd.checkpoint", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to_file = commands.add_parser("export", help="a sharded checkpoint folder -> one file of whole tensors")
    to_file.add_argument("ckpt", type=Path, help="checkpoint folder written by NDParallel")
    to_file.add_argument("out", type=Path, help="file to write")
    to_file.add_argument("--format", choices=("safetensors", "torch"), default=None,
                         help="default: torch for a .ckpt or .pt OUT (a Lightning checkpoint, a pickle), else"
                              " safetensors (cannot carry code; NDParallel resumes from it under any layout)")
    to_file.add_argument("--module", default=None,
                         help="keep only this attribute's weights, without its prefix (e.g. `model` for Hugging Face)")
    check = commands.add_parser("verify", help="every file present, at its size and checksum")
    check.add_argument("ckpt", type=Path)
    newest = commands.add_parser("latest", help="print the newest complete checkpoint in a folder")
    newest.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            print(export(args.ckpt, args.out, args.format, module=args.module, progress=_progress))
        elif args.command == "verify":
            manifest = read_manifest(args.ckpt)
            if found := problems(args.ckpt, manifest):
                raise CheckpointError(f"`{args.ckpt}`: " + "; ".join(found))
            print(f"{args.ckpt}: complete, {len(manifest['files'])} files, step {manifest.get('global_step')},"
                  f" layout {manifest.get('layout')} on {manifest.get('world_size')} ranks")
        else:
            found = latest_checkpoint(args.folder)
            if found is None:
                raise CheckpointError(f"No complete checkpoint in `{args.folder}`.")
            print(found)
    except (CheckpointError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001 - a file from anywhere: one line, never a traceback
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
