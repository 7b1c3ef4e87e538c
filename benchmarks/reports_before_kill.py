"""Every rank's report is written before its launcher ends the run: the real out-of-memory fault of
`tests/e2e/oom_script.py` (pp=2 x dp_shard=2, rank 1 of 4 asks for 1 PiB in step 2), run ``--runs`` times
under Lightning's own launcher and as many under torchrun. Per launcher it prints in how many runs all 4
``memory-rank<R>.json`` were written naming the culprit, and the seconds from the fault to the last process's exit.

    python benchmarks/reports_before_kill.py --runs 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.oom_script import LAUNCHERS, run  # noqa: E402

VICTIM = 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--launchers", nargs="+", default=list(LAUNCHERS), choices=list(LAUNCHERS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        for launcher in args.launchers:
            whole, seconds, missing = 0, [], []
            for attempt in range(args.runs):
                outcome = run(launcher, Path(root) / f"{launcher}{attempt}", VICTIM)
                complete = len(outcome.cards) == 4 and all(c["culprit"] == VICTIM for c in outcome.cards.values())
                whole += complete
                missing.append(sorted(set(range(4)) - set(outcome.cards)))
                if outcome.fault_to_last_exit_s is not None:
                    seconds.append(outcome.fault_to_last_exit_s)
                print(f"  {launcher} run {attempt + 1}: exit {outcome.code}, cards of ranks {sorted(outcome.cards)},"
                      f" fault to last exit {outcome.fault_to_last_exit_s or float('nan'):.1f} s", flush=True)
            spread = f"{min(seconds):.1f} / {statistics.median(seconds):.1f} / {max(seconds):.1f}" if seconds else "-"
            print(f"{launcher}: {whole} of {args.runs} runs had every rank's card; fault to last exit (s)"
                  f" min / median / max: {spread}; ranks without a card per run: {missing}", flush=True)


if __name__ == "__main__":
    main()
