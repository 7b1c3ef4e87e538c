"""The fuzz suite (`fuzz_readers.py`) in a subprocess of its own: every reader of a file or a store value from elsewhere
took its 200 malformed inputs, each within `EXAMPLE_S`, none ending in another exception than the reader's own answer
(the subprocess fails with hypothesis's smallest failing input otherwise), and the process stayed under 1 GB of
resident memory (its peak RSS: an address-space limit would break torch itself)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.launcher import REPO
from tests.unit.fuzz_readers import EXAMPLE_S, EXAMPLES

READERS = ["checkpoint manifest", "checkpoint meta.json", "DCP index (.metadata)", "format-1 meta.pt and rng-<R>.pt",
           "safetensors export", "capture.json (hang)", "flight-recorder dump (hang)", "NCCL log (nccl)",
           "profiler trace (trace)", "sweep's overrides.yaml and run.json (compare)", "a peer's capture in the store",
           "a verdict in the store"]
PEAK_MB = 1024


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz") / "report.json"
    done = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.unit.fuzz_readers", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("reader", READERS)
def test_a_reader_takes_its_malformed_inputs_within_its_budgets(fuzzed, reader):
    found = fuzzed[reader]
    assert found["tried"] == EXAMPLES and found["slowest_s"] < EXAMPLE_S
    assert found["peak_rss_mb"] < PEAK_MB, found


def test_the_report_names_every_reader(fuzzed):
    assert sorted(fuzzed) == sorted(READERS)
