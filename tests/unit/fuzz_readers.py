"""Every reader of a file (or a store value) from elsewhere, fed 200 malformed inputs each by hypothesis (derandomised):
real files cut, flipped and spliced, and values built from nothing. Each input must end in the reader's own answer (a
value, a skip, a `CheckpointError`, an exit status of 2 with one line) within `EXAMPLE_S`, never another exception.

    python -m tests.unit.fuzz_readers OUT.json

runs them all in this process and writes, per reader, the inputs tried, the slowest one and the process's peak RSS so
far (`test_fuzz_readers.py` runs it as a subprocess and holds them to their budgets).
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import resource
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

DATA = Path(__file__).resolve().parents[1] / "data"
EXAMPLES = 200
EXAMPLE_S = 5.0
SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))

JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=10), inner, max_size=6),
                    max_leaves=40)


def mutated(base: bytes) -> st.SearchStrategy[bytes]:
    """``base`` cut short, with bytes flipped, or with a run of random bytes spliced in."""
    def change(edit: tuple[int, int, bytes, int]) -> bytes:
        kind, at, splice, cut = edit
        at %= max(len(base), 1)
        if kind == 0:
            return base[:at]
        if kind == 1:
            return base[:at] + bytes([base[at] ^ 0xFF]) + base[at + 1:] if base else b""
        return base[:at] + splice + base[at + cut:]
    return st.tuples(st.integers(0, 2), st.integers(0, 1 << 30), st.binary(max_size=64), st.integers(0, 64)).map(change)


def json_bytes(values: st.SearchStrategy = JSON) -> st.SearchStrategy[bytes]:
    return values.map(lambda value: json.dumps(value, allow_nan=True).encode())


def _timed(name: str, check: Callable[[Any], None], inputs: st.SearchStrategy, report: dict[str, Any]) -> None:
    tried, slowest = [0], [0.0]

    @SETTINGS
    @given(inputs)
    def run(value: Any) -> None:
        start = time.perf_counter()
        check(value)
        tried[0] += 1
        slowest[0] = max(slowest[0], time.perf_counter() - start)
        assert slowest[0] < EXAMPLE_S, f"{name}: an input took {slowest[0]:.1f} s"

    run()
    report[name] = {"tried": tried[0], "slowest_s": slowest[0],
                    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


@contextlib.contextmanager
def quiet():
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        yield


# ---- checkpoint folders ---------------------------------------------------------------------------------------------

def _checkpoint(root: Path) -> Path:
    from tests.unit.checkpoint_folders import one_rank_checkpoint

    path = root / "base" / "step=1.ckpt"
    one_rank_checkpoint(path, {"model": {"w": torch.randn(4, 3)}, "optimizer_0": {"state": {}, "param_groups": [
        {"lr": 0.1, "betas": (0.9, 0.99)}]}}, {"global_step": 1, "lightning_nd": {"param_names": [[["w"]]]}},
        info={"global_step": 1})
    return path


def _with(base: Path, root: Path, name: str, data: bytes) -> Path:
    """A copy of the checkpoint ``base`` whose ``name`` holds ``data`` (the manifest left as it was)."""
    path = root / "case" / "step=1.ckpt"
    shutil.rmtree(path.parent, ignore_errors=True)
    shutil.copytree(base, path)
    (path / name).write_bytes(data)
    return path


def checkpoint_readers(root: Path, report: dict[str, Any]) -> None:
    from lightning_nd.checkpoint import CheckpointError, files, listing, read_sharded
    from lightning_nd.checkpoint.__main__ import main
    from lightning_nd.checkpoint.checked_reader import read_index
    from lightning_nd.checkpoint.export import export, read_export
    from lightning_nd.checkpoint.json_state import read_json

    base = _checkpoint(root)
    manifest = (base / files.MANIFEST).read_bytes()

    def manifest_reader(data: bytes) -> None:
        path = _with(base, root, files.MANIFEST, data)
        with contextlib.suppress(CheckpointError):
            files.read_manifest(path)
        listing.complete_checkpoints(path.parent)
        with quiet():
            assert main(["verify", str(path)]) in (0, 2)

    _timed("checkpoint manifest", manifest_reader, mutated(manifest) | json_bytes(), report)

    def state_reader(data: bytes) -> None:
        path = _with(base, root, files.META, data)
        with contextlib.suppress(CheckpointError):
            read_json(path / files.META, 1 << 20)

    tagged = st.fixed_dictionaries({"$type": st.sampled_from(["tuple", "set", "dict", "tensor", "ndarray", "numpy",
                                                              "path", "omegaconf", "?"])}, optional={
        "items": JSON, "dtype": st.sampled_from(["float32", "uint8", "int64", "bool", "?"]), "value": JSON,
        "shape": st.lists(st.integers(-2, 1 << 40), max_size=4), "data": st.text(max_size=40), "yaml": st.text()})
    _timed("checkpoint meta.json", state_reader,
           mutated((base / files.META).read_bytes()) | json_bytes(st.recursive(tagged | JSON, lambda inner: st.lists(
               inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4), max_leaves=20)), report)

    def index_reader(data: bytes) -> None:
        path = _with(base, root, files.DCP_METADATA, data)
        with contextlib.suppress(CheckpointError):
            read_index(path)
        with contextlib.suppress(CheckpointError):
            read_sharded(path, progress=lambda _: None)  # the checksum refuses most; what passes it is read

    metadata = (base / files.DCP_METADATA).read_bytes()
    plain = JSON.map(lambda value: pickle.dumps(value))
    _timed("DCP index (.metadata)", index_reader, mutated(metadata) | plain, report)

    legacy = root / "legacy.pt"
    torch.save({"global_step": 1, "hyper_parameters": {"lr": 0.1, "path": Path("/x")}}, legacy)

    def legacy_reader(data: bytes) -> None:
        from lightning_nd.checkpoint import trusted

        (root / "fuzzed.pt").write_bytes(data)
        with contextlib.suppress(CheckpointError):
            trusted.load_meta(root / "fuzzed.pt")
        with contextlib.suppress(CheckpointError):
            trusted.load_rng(root / "fuzzed.pt")

    _timed("format-1 meta.pt and rng-<R>.pt", legacy_reader, mutated(legacy.read_bytes()), report)

    exported = export(base, root / "export.safetensors", progress=lambda _: None)

    def export_reader(data: bytes) -> None:
        (root / "fuzzed.safetensors").write_bytes(data)
        with contextlib.suppress(CheckpointError):
            read_export(root / "fuzzed.safetensors")

    _timed("safetensors export", export_reader, mutated(exported.read_bytes()), report)


# ---- diagnostics and the watchdog -----------------------------------------------------------------------------------

def _folder(root: Path, files: dict[str, bytes]) -> Path:
    folder = root / "diag"
    shutil.rmtree(folder, ignore_errors=True)
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def _cli(*argv: str) -> None:
    from diagnostics.__main__ import main

    with quiet():
        assert main(list(argv)) in (0, 1, 2)


def diagnostics_readers(root: Path, report: dict[str, Any]) -> None:
    captures = DATA / "records" / "hang_pp2_dp2"
    capture = (captures / "rank0" / "capture.json").read_bytes()
    others = {f"rank{r}/capture.json": (captures / f"rank{r}" / "capture.json").read_bytes() for r in (1, 2, 3)}
    _timed("capture.json (hang)",
           lambda data: _cli("hang", str(_folder(root, {**others, "rank0/capture.json": data}))),
           mutated(capture) | json_bytes(), report)

    dump = pickle.dumps({"version": "2.10", "entries": [
        {"collective_seq_id": seq, "profiling_name": "gloo:all_reduce", "process_group": ("1", "dp"),
         "input_sizes": [[4, 8]], "input_dtypes": ["Float"], "retired": seq < 9, "frames": [
             {"filename": "train.py", "line": 10, "name": "step"}]} for seq in range(1, 10)],
        "pg_config": {"1": {"name": "1", "desc": "dp", "ranks": "[0, 1]"}}})
    _timed("flight-recorder dump (hang)", lambda data: _cli("hang", str(_folder(root, {"fr_rank_0": data}))),
           mutated(dump) | JSON.map(pickle.dumps) | json_bytes(), report)

    log = (DATA / "nccl" / "single_node_nvlink" / "nccl.rank0.dgx-h100-07.48211.log").read_bytes()
    lines = st.lists(st.sampled_from(log.splitlines()) | st.binary(max_size=200), max_size=30).map(b"\n".join)
    _timed("NCCL log (nccl)", lambda data: _cli("nccl", str(_folder(root, {"nccl.rank0.h.1.log": data}))),
           mutated(log[:20000]) | lines, report)

    trace = next((DATA / "traces" / "cp2_fsdp2").iterdir()).read_bytes()
    events = json_bytes(st.fixed_dictionaries({"traceEvents": st.lists(JSON, max_size=8)}, optional={
        "distributedInfo": JSON}))
    _timed("profiler trace (trace)",
           lambda data: _cli("trace", str(_folder(root, {"rank0.json": data, "rank1.json.gz": zlib.compress(data)}))),
           mutated(trace[:50000]) | events, report)

    overrides = st.text(max_size=200).map(str.encode) | st.just(b"- a=1\n- b: &x [*x]\n")
    _timed("sweep's overrides.yaml and run.json (compare)",
           lambda pair: _cli("compare", str(_folder(root, {"0/.hydra/overrides.yaml": pair[0],
                                                           "0/diagnostics/run.json": pair[1]})), "--no-tensorboard"),
           st.tuples(overrides, json_bytes()), report)

    from diagnostics.collect.exchange import unpacked
    from lightning_nd.runtime.watchdog import parse_verdict

    _timed("a peer's capture in the store", unpacked,
           st.binary(max_size=300) | mutated(zlib.compress(capture)) | json_bytes().map(zlib.compress), report)
    _timed("a verdict in the store", lambda data: parse_verdict(data, 8), st.binary(max_size=100) | st.from_regex(
        rb"\A-?\d{0,30}\|?.{0,40}\Z"), report)


def main(out: str) -> None:
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        checkpoint_readers(Path(folder), report)
        diagnostics_readers(Path(folder), report)
    Path(out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
