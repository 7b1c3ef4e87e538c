"""The offline readers of `python -m diagnostics` on files crafted to cost time, memory or a traceback: each ends in
its own answer (a verdict with the bad file skipped and named, or one line and exit status 2) within 5 s and 1 GB of
peak RSS, measured on the CLI's own process. At db1c3e6: the dump naming rank 10^11 grew to 5.8 GB, the dump naming
one frames list 16 million times ran for minutes, `Infinity` and a 100k-deep capture ended in tracebacks, and the
40k-character NCCL line took 43 s."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CAPTURES = REPO / "tests" / "data" / "records" / "hang_pp2_dp2"
LIMIT_S, LIMIT_MB = 5.0, 1024
KILL_S = 60


def _dump(ranks: str, entries: list[dict]) -> bytes:
    return pickle.dumps({"version": "2.10", "entries": entries,
                         "pg_config": {"1": {"name": "1", "desc": "dp", "ranks": ranks}}})


def _entry(frames: list[dict]) -> dict:
    return {"collective_seq_id": 1, "profiling_name": "gloo:all_reduce", "process_group": ("1", "dp"),
            "input_sizes": [[4]], "input_dtypes": ["Float"], "retired": False, "frames": frames}


def _capture_with(text: bytes) -> dict[str, bytes]:
    return {f"rank{r}/capture.json": (CAPTURES / f"rank{r}" / "capture.json").read_bytes() for r in (1, 2, 3)} | {
        "rank0/capture.json": text}


FRAMES = [{"filename": "train.py", "line": 1, "name": "f"}] * 4096
CASES = {
    "a dump naming rank 10^11": ("hang", {"fr_rank_0": _dump("[0, 100000000000]", [_entry([])])}, 2,
                                 "is not a rank (0 to 131071)"),
    "one frames list named 16M times": ("hang", {"fr_rank_0": _dump("[0, 1]", [_entry(FRAMES)] * 4096)}, 1,
                                        "rank 1 left no capture"),
    "Infinity in a capture": ("hang", _capture_with((CAPTURES / "rank0" / "capture.json").read_bytes().replace(
        b'"step": 2', b'"step": Infinity')), 1, "`Infinity` is not a JSON number"),
    "a capture nested 100k deep": ("hang", _capture_with(b"[" * 100_000 + b"]" * 100_000), 1, "nested too deep"),
    "a 40k-character NCCL line": ("nccl", {"nccl.rank0.h.1.log": b"x" * 40_000 + b"\n"}, 0, "NCCL logs of 1 rank"),
}


# The CLI's own time, without the interpreter's start (a loaded host stretches that, not what is bounded).
CHILD = ("import sys, time; from diagnostics.__main__ import main; start = time.perf_counter(); code = main(sys.argv[2:]);"
         " open(sys.argv[1], 'w').write(str(time.perf_counter() - start)); sys.exit(code)")


def _run(argv: list[str], timing: Path) -> tuple[int, str, float, float]:
    """The CLI in a process of its own: exit status, its output, its seconds, its peak RSS in MB (from wait4)."""
    with tempfile.TemporaryFile() as out:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(timing), *argv], cwd=REPO, stdout=out, stderr=out)
        killer = threading.Timer(KILL_S, child.kill)
        killer.start()
        _, status, usage = os.wait4(child.pid, 0)
        killer.cancel()
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        seconds = float(timing.read_text()) if timing.exists() else float("inf")
        return child.returncode, out.read().decode(errors="replace"), seconds, usage.ru_maxrss / 1024


@pytest.mark.parametrize("case", list(CASES))
def test_a_crafted_record_ends_in_its_readers_answer_in_bounded_time_and_memory(tmp_path, case):
    command, files, code, said = CASES[case]
    for name, data in files.items():
        (tmp_path / "run" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "run" / name).write_bytes(data)
    status, output, seconds, peak_mb = _run([command, str(tmp_path / "run")], tmp_path / "seconds")
    assert "Traceback" not in output and status == code and said in output, output[-3000:]
    assert seconds < LIMIT_S and peak_mb < LIMIT_MB, (seconds, peak_mb)
    if code == 2:
        assert len(output.strip().splitlines()) == 1, output
