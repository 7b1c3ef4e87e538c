"""The dry run of a 70B Llama at 64 devices, timed as a whole process beside the bare import of torch and
transformers, interleaved on the same machine; the aim is at most 1.5 s over the import.

A third process imports Llama's modeling module as well (``from transformers import LlamaForCausalLM``): the
dry run builds the model on the meta device, so it cannot do without that import, which loads
``torch.distributed.tensor``, FSDP and dynamo for transformers itself. The last row is what the dry run adds
over that floor: our imports, building the model, planning and printing.

    python benchmarks/dry_run.py [--rounds 5] [--check]

With ``--check`` it also times ``--check`` on the same layout (``--seq-len 4096``, the default 8 microbatches of
one sample): its four pipeline stages set up and stepped on fake tensors, whole process, and its peak memory.

Each round runs the three commands once, in a rotating order; medians over the rounds. The dry run's own
timing line (planning alone) and whether it loaded Lightning are reported from one extra run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LLAMA_70B = {"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
             "intermediate_size": 28672, "vocab_size": 128256}
DRY_RUN = [sys.executable, "-m", "lightning_nd.plan", "--hf-model-type", "llama", "--hf-kwargs", json.dumps(LLAMA_70B),
           "--devices", "64", "--layout", "tp=8,pp=4,dp_shard=2", "--gpus-per-node", "8"]
IMPORT = [sys.executable, "-c", "import torch, transformers"]
FLOOR = [sys.executable, "-c", "import torch, transformers; from transformers import LlamaForCausalLM"]
CHECK = """
import runpy, sys
sys.argv = ["lightning_nd.plan", *{argv!r}]
try:
    runpy.run_module("lightning_nd.plan", run_name="__main__")
except SystemExit:
    pass
print("LOADED", "lightning" in sys.modules, "torch.distributed.pipelining" in sys.modules, file=sys.stderr)
"""


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])} ... failed:\n{done.stderr[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="also time `--check` of the 70B layout once")
    options = parser.parse_args()
    rounds = options.rounds
    dry, bare, floor = [], [], []
    commands = [(dry, DRY_RUN), (bare, IMPORT), (floor, FLOOR)]
    for round_ in range(rounds):
        for samples, command in commands[round_ % 3:] + commands[:round_ % 3]:
            samples.append(timed(command))
    check = subprocess.run([sys.executable, "-c", CHECK.format(argv=DRY_RUN[3:])], cwd=REPO, capture_output=True,
                           text=True)
    planned = next((line for line in check.stderr.splitlines() if line.startswith("Planned in")), "?")
    loaded = next((line.split()[1:] for line in check.stderr.splitlines() if line.startswith("LOADED")), ["?", "?"])
    median_dry, median_bare, median_floor = (statistics.median(samples) for samples in (dry, bare, floor))
    print(f"| what ({rounds} rounds, medians) | seconds |\n|---|---|")
    print(f"| `python -c \"import torch, transformers\"` | {median_bare:.2f} |")
    print(f"| `... ; from transformers import LlamaForCausalLM` | {median_floor:.2f} |")
    print(f"| `python -m lightning_nd.plan` 70B Llama, tp=8 pp=4 dp_shard=2 on 64 | {median_dry:.2f} |")
    print(f"| dry run - bare import (aim: at most 1.50) | {median_dry - median_bare:+.2f} |")
    print(f"| of which Llama's modeling import | {median_floor - median_bare:+.2f} |")
    print(f"| of which the dry run itself | {median_dry - median_floor:+.2f} |")
    print(f"\nThe dry run's own line: \"{planned}\"; Lightning loaded: {loaded[0]}, pipelining loaded: {loaded[1]}.")
    print(f"All samples: dry run {[round(s, 2) for s in dry]}, import {[round(s, 2) for s in bare]},"
          f" with Llama {[round(s, 2) for s in floor]}")
    if options.check:
        time_check()


def time_check() -> None:
    """``--check`` of the 70B layout: wall time of the whole process and its peak resident memory (aim: 60 s)."""
    import resource

    start = time.perf_counter()
    done = subprocess.run([*DRY_RUN, "--seq-len", "4096", "--check"], cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    verdict = next((line for line in done.stdout.splitlines() if line.startswith(("Every", "First", "No failure"))),
                   done.stderr[-500:])
    print(f"\n`--check`, 70B Llama on 64 ranks: {wall:.1f} s wall (aim: under 60), peak {peak:.2f} GB, exit"
          f" {done.returncode}: {verdict}")


if __name__ == "__main__":
    main()
