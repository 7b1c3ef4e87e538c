"""Entry point of one rank started by `tests.launcher.launch`: run the target, save its result."""

from __future__ import annotations

import importlib
import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    target, kwargs, out_dir = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    module_name, function_name = target.split(":")
    result = getattr(importlib.import_module(module_name), function_name)(**kwargs)
    torch.save(result, os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))
    if dist.is_initialized():
        dist.barrier()  # without it a rank may abort at shutdown while another still talks to it
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
