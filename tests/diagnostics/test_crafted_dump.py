"""`python -m diagnostics hang` reads flight-recorder dumps as plain data (`flight_recorder.load_dump`): a crafted
``fr_rank_0`` (its pickle would create a marker file, as the old ``pickle.loads`` did) is refused with one line naming
the file and exit status 2, the marker never appears; garbage, a truncated pickle or data of another shape are refused
the same way; a real dump torch wrote (gloo, one rank), as a pickle or as JSON, still reads."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from diagnostics.__main__ import main
from diagnostics.collect.flight_recorder import load_dump

REPO = Path(__file__).resolve().parents[2]
ONE_RANK_DUMP = """
import sys, tempfile
import torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
dist.all_reduce(torch.ones(3))
dist.barrier()
c10d = torch._C._distributed_c10d
open(sys.argv[1] + "/fr_rank_0", "wb").write(c10d._dump_fr_trace(True, True, False))
open(sys.argv[1] + "/fr_rank_0.json", "wb").write(c10d._dump_fr_trace_json(True, True))
dist.destroy_process_group()
"""


class Touches:
    """Unpickled, creates ``marker``: the stand-in for whatever code a crafted dump would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return pathlib.Path.touch, (self.marker,)


@pytest.fixture(scope="module")
def real_dump(tmp_path_factory) -> Path:
    """Torch's own dump of one gloo all_reduce, in a process of its own (the flight recorder is per process)."""
    folder = tmp_path_factory.mktemp("fr")
    subprocess.run([sys.executable, "-c", ONE_RANK_DUMP, str(folder)], check=True, timeout=120,
                   env={**os.environ, "TORCH_FR_BUFFER_SIZE": "2000"})
    return folder


def _refused(folder: Path, capsys) -> str:
    assert main(["hang", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("python -m diagnostics hang: ") and f"{folder / 'fr_rank_0'} is not a flight-recorder dump" in err
    return err


def test_a_crafted_dump_is_refused_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "ran"
    crafted = pickle.dumps({"version": "2.10", "pg_config": {}, "entries": [], "pg_status": Touches(marker)})
    pickle.loads(crafted)
    assert marker.exists(), "the crafted dump did not run its code the old way: the test would prove nothing"
    marker.unlink()
    (tmp_path / "fr_rank_0").write_bytes(crafted)
    assert "it names `pathlib.Path.touch`, which a flight-recorder dump never holds" in _refused(tmp_path, capsys)
    assert not marker.exists()


def test_the_command_refuses_a_crafted_dump_without_a_traceback(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "fr_rank_0").write_bytes(pickle.dumps({"entries": [], "pg_config": Touches(marker)}))
    done = subprocess.run([sys.executable, "-m", "diagnostics", "hang", str(tmp_path)], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "fr_rank_0" in done.stderr, done.stderr
    assert not marker.exists()


@pytest.mark.parametrize("content", [
    b"\x00\xffnot a pickle",
    pickle.dumps({"entries": [{"profiling_name": "gloo:all_reduce"}] * 50})[:40],  # truncated
    pickle.dumps(["a", "list"]),
    json.dumps({"entries": [1, 2]}).encode(),  # plain data, but no dump's entries
], ids=["garbage", "truncated", "not-a-dict", "wrong-shape"])
def test_a_file_that_is_not_a_dump_is_refused_in_one_line(tmp_path, capsys, content):
    (tmp_path / "fr_rank_0").write_bytes(content)
    _refused(tmp_path, capsys)


def test_a_real_dump_reads_as_pickle_and_as_json(real_dump, tmp_path, capsys):
    data = (real_dump / "fr_rank_0").read_bytes()
    dump = load_dump(real_dump / "fr_rank_0")
    assert dump == pickle.loads(data) and dump["entries"][0]["profiling_name"] == "gloo:all_reduce"
    as_json = load_dump(real_dump / "fr_rank_0.json")
    assert [e["collective_seq_id"] for e in as_json["entries"]] == [e["collective_seq_id"] for e in dump["entries"]]
    (tmp_path / "fr_rank_0").write_bytes(data)
    assert main(["hang", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no culprit found" in out and "captured ranks [0]" in out, out
