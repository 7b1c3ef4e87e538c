"""NCCL INFO logs -> records -> findings -> report, on the recorded corpus in tests/data/nccl (one folder per
scenario, one file per rank; see its SOURCES.md) and on short texts for older line shapes and for garbage."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from diagnostics.__main__ import main
from diagnostics.analysis.nccl_findings import nccl_findings, topology_table
from diagnostics.analysis.nccl_log import parse_nccl_dir, parse_nccl_log, rank_from_name
from diagnostics.records import NcclRankLog
from diagnostics.report.nccl_card import nccl_markdown

CORPUS = Path(__file__).resolve().parents[1] / "data" / "nccl"
REPO = CORPUS.parents[2]


def _load(scenario: str) -> list[NcclRankLog]:
    return parse_nccl_dir(CORPUS / scenario)


def _comm(log: NcclRankLog, index: int = 0):
    return list(log.comms.values())[index]


def _roles() -> dict:
    return json.loads((CORPUS / "tp_across_nodes" / "layout.json").read_text())["roles"]


def test_single_node_nvlink_uses_cumem_p2p_and_nvls():
    logs = _load("single_node_nvlink")
    assert [log.global_rank for log in logs] == list(range(8))
    assert (logs[0].nccl_version, logs[0].cuda_version, logs[0].cuda_driver_version) == ("2.21.5", "12.4", "12.4")
    assert logs[1].nccl_version is None  # <= 2.21 logs it only where the process is a communicator's rank 0
    comm = _comm(logs[3])
    assert (comm.rank, comm.n_ranks, comm.n_nodes, comm.local_ranks) == (3, 8, 1, 8)
    assert (comm.cuda_dev, comm.bus_id, comm.network) == (3, "5d000", "IB")
    assert (comm.coll_channels, comm.nvls_channels, comm.p2p_channels, comm.p2p_channels_per_peer) == (24, 16, 32, 32)
    assert comm.nvls and comm.nvls_support and comm.init_complete
    assert comm.transports_by_peer() == {2: ("P2P/CUMEM/read",), 4: ("P2P/CUMEM/read",)}
    assert len(_comm(logs[0]).rings) == 24 and _comm(logs[0]).rings[5] == tuple(range(8))
    assert _comm(logs[0]).trees[0] == "1/-1/-1->0->-1" and _comm(logs[7]).trees[23] == "-1/-1/-1->7->6"
    assert len({_comm(log).comm_id for log in logs}) == 1
    assert nccl_findings(logs) == []


def test_multi_node_ib_crosses_nodes_with_gdrdma_only_at_the_node_boundary():
    logs = _load("multi_node_ib")
    assert {log.hosts for log in logs} == {("gpu-node-01",), ("gpu-node-02",)}
    assert logs[0].ib_devices == ("mlx5_0:1/IB", "mlx5_1:1/IB", "mlx5_2:1/IB", "mlx5_3:1/IB")
    comm = _comm(logs[3])
    assert (comm.n_nodes, comm.local_ranks, comm.network, comm.channels, comm.nvls) == (2, 4, "IB", 8, False)
    assert comm.transports_by_peer() == {2: ("P2P/CUMEM/read",), 4: ("NET/IB/GDRDMA",)}
    assert [c.transport for c in comm.connections[:2]] == ["NET/IB/0/GDRDMA", "NET/IB/1/GDRDMA"]
    assert _comm(logs[4]).transports_by_peer() == {0: ("NET/IB/GDRDMA",), 3: ("NET/IB/GDRDMA",), 5: ("P2P/CUMEM/read",)}
    assert _comm(logs[0]).trees[:2] == ("1/4/-1->0->-1", "1/-1/-1->0->4")
    [row] = topology_table(logs)
    assert row["transports"] == ("NET/IB/GDRDMA", "P2P/CUMEM/read") and row["init_complete"] == "8/8"
    assert nccl_findings(logs) == []


def test_socket_fallback_is_a_warning_naming_the_missing_ib_devices():
    logs = _load("socket_fallback")
    assert logs[2].ib_absent and logs[2].networks == ("Socket",)
    assert logs[2].socket_interfaces == ("eth0:10.0.1.11<0>",)
    assert _comm(logs[1]).transports_by_peer() == {0: ("SHM",), 2: ("NET/Socket",)}
    [finding] = nccl_findings(logs)
    assert (finding.severity, finding.ranks) == ("warning", (0, 1, 2, 3))
    assert "NET/IB : No device found" in finding.detail and "NCCL_SOCKET_IFNAME" in finding.advice


def test_mixed_versions_are_an_error_and_init_stops_on_every_rank():
    logs = _load("mixed_versions")
    assert [(log.nccl_version, log.cuda_version) for log in logs] == [("2.23.4", "12.6")] * 2 + [("2.22.3", "12.4")] * 2
    assert "Mismatched NCCL version detected" in logs[0].warnings[0]
    findings = nccl_findings(logs)
    assert [(f.severity, f.title) for f in findings] == [
        ("error", "NCCL versions differ across ranks"), ("error", "NCCL init never completed"),
        ("info", "CUDA drivers differ across ranks")]
    assert "2.22.3 (ranks 2-3 on gpu-b); 2.23.4 (ranks 0-1 on gpu-a)" in findings[0].detail
    assert "torch.cuda.nccl.version()" in findings[0].advice and findings[1].ranks == (0, 1, 2, 3)


def test_a_rank_that_never_completed_init_is_named():
    logs = _load("init_incomplete")
    assert [_comm(log).init_complete for log in logs] == [True, True, True, False]
    stuck = _comm(logs[3])
    assert stuck.coll_channels is None and stuck.channels == 8  # counted from its Channel lines
    [finding] = nccl_findings(logs)
    assert (finding.severity, finding.ranks) == ("error", (3,)) and "ranks 0-2 completed" in finding.detail


def test_a_rank_without_a_log_or_without_the_communicator_is_an_error(tmp_path):
    gone, cut = (shutil.copytree(CORPUS / "init_incomplete", tmp_path / name) for name in ("gone", "cut"))
    next(gone.glob("nccl.rank2.*")).unlink()
    missing = [f for f in nccl_findings(parse_nccl_dir(gone)) if f.title == "No NCCL log for some ranks"]
    assert [f.ranks for f in missing] == [(2,)] and "NCCL_DEBUG_FILE" in missing[0].advice
    header_only = next(cut.glob("nccl.rank1.*"))
    header_only.write_text("\n".join(header_only.read_text().splitlines()[:6]))  # NCCL loaded, no init begun
    [absent] = [f for f in nccl_findings(parse_nccl_dir(cut)) if "was started by 3 of its 4" in f.title]
    assert absent.ranks == (1,) and "rank(s) 1 never start it" in absent.detail
    extra = nccl_findings(_load("tp_across_nodes"), {"tp": [[0, 1], [2, 3], [4, 5]]})
    assert [f.ranks for f in extra if f.title == "No NCCL log for some ranks"] == [(4, 5)]


def test_p2p_disabled_by_variable():
    logs = _load("p2p_disabled")
    assert logs[1].env == {"NCCL_P2P_DISABLE": "1"}
    assert [c.transport for c in _comm(logs[1]).connections][:1] == ["SHM/direct/direct"]
    [finding] = nccl_findings(logs)
    assert (finding.severity, finding.ranks) == ("warning", (0, 1, 2, 3)) and "NCCL_P2P_DISABLE" in finding.advice


def test_tp_groups_across_nodes_are_mapped_to_their_role_and_warned():
    logs, roles = _load("tp_across_nodes"), _roles()
    rows = {row["ranks"]: row for row in topology_table(logs, roles)}
    assert {ranks: row["role"] for ranks, row in rows.items()} == {
        (0, 1, 2, 3): "world", (0, 1): "tp", (2, 3): "tp",
        (0, 2): "dp_shard, batch, fsdp, loss, hsdp", (1, 3): "dp_shard, batch, fsdp, loss, hsdp"}
    assert rows[(0, 1)]["transports"] == ("NET/IB/GDRDMA",) and rows[(0, 1)]["n_nodes"] == 2
    assert rows[(0, 2)]["transports"] == ("P2P/CUMEM/read",) and rows[(0, 2)]["channels"] == 8
    [finding] = nccl_findings(logs, roles)
    assert (finding.severity, finding.ranks) == ("warning", (0, 1, 2, 3)) and "`tp`" in finding.title
    assert "LOCAL_WORLD_SIZE" in finding.advice and "node-a, node-b" in finding.detail
    assert nccl_findings(logs) == []  # without roles nothing says which communicator is tp
    node_local_tp = {"tp": [[0, 2], [1, 3]], "dp_shard": [[0, 1], [2, 3]]}
    assert nccl_findings(logs, node_local_tp) == []


def _line(host: str, pid: int, message: str, tid: int | None = None, dev: int = 0) -> str:
    return f"{host}:{pid}:{tid or pid} [{dev}] NCCL INFO {message}"


def test_lines_without_a_pointer_belong_to_the_communicator_their_thread_is_initialising():
    def init(pointer: str, nranks: int, state: str, tid: int) -> str:
        return _line("h", 7, f"ncclCommInitRank comm {pointer} rank 0 nranks {nranks} cudaDev 0 nvmlDev 0 busId 7000"
                     f" commId 0x{pointer[-2:]}ff - Init {state}", tid)
    text = "\n".join([
        _line("h", 7, "Using network IB", 8), init("0x55aa", 2, "START", 8),
        init("0x55cc", 4, "START", 9), _line("h", 7, "Using network Socket", 9),  # another thread, meanwhile
        _line("h", 7, "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM", 8), init("0x55aa", 2, "COMPLETE", 8),
        _line("h", 7, "Using network Socket", 8),  # logged before the next init on this thread starts
        init("0x55bb", 2, "START", 8), init("0x55bb", 2, "COMPLETE", 8),
        _line("h", 7, "Channel 02/1 : 0[0] -> 1[1] via P2P/CUMEM/read", 8)])  # p2p connects lazily, after init
    comms = parse_nccl_log(text, 0).comms
    assert [(c.network, c.init_complete) for c in comms.values()] == [("IB", True), ("Socket", False), ("Socket", True)]
    assert [c.channel for c in comms["0x55aa"].connections] == [0] and comms["0x55bb"].connections[0].channel == 2


def test_split_communicators_without_comm_id_group_by_parent_and_color():
    # NCCL 2.23+ (src/init.cc): a ncclCommSplit child logs "parent %p color %d key %d" and no commId.
    texts = []
    for rank, parent, child in ((0, "0x5550aa", "0x5550bb"), (1, "0x5551aa", "0x5551bb")):
        texts.append("\n".join([
            _line("h", 10 + rank, f"ncclCommInitRank comm {parent} rank {rank} nranks 2 cudaDev {rank} nvmlDev {rank}"
                  " busId 7000 commId 0x1234abcd - Init COMPLETE"),
            _line("h", 10 + rank, f"ncclCommSplit comm {child} rank {rank} nranks 2 cudaDev {rank} nvmlDev {rank}"
                  f" busId 7000 parent {parent} color 7 key {rank}- Init START", tid=99),
            _line("h", 10 + rank, f"Channel 00/0 : {rank}[{rank}] -> {1 - rank}[{1 - rank}] via P2P/CUMEM", tid=99),
            _line("h", 10 + rank, f"ncclCommSplit comm {child} rank {rank} nranks 2 cudaDev {rank} nvmlDev {rank}"
                  f" busId 7000 parent {parent} color 7 key {rank} - Init COMPLETE", tid=99)]))
    logs = [parse_nccl_log(text, rank) for rank, text in enumerate(texts)]
    assert {_comm(log, 1).group_id for log in logs} == {"0x1234abcd/split:color7:n2"}
    rows = topology_table(logs, {"tp": [[0, 1]]})
    assert [(row["role"], row["transports"]) for row in rows] == [("tp", ()), ("tp", ("P2P/CUMEM",))]


def test_older_and_prefixed_line_shapes():
    text = "\n".join([
        "NCCL version 2.7.8+cuda11.0",  # <= 2.21 prints it bare to stdout, which launchers merge in
        "[1,5]<stdout>:ip-10-0-0-5:1760:1771 [1] NCCL INFO Channel 00 : 4[1b0] -> 5[1c0] [receive] via NET/Socket/0",
        "node0: ip-10-0-0-5:1760:1771 [1] NCCL INFO 8 coll channels, 8 p2p channels, 1 p2p channels per peer",
        _line("ip-10-0-0-5", 1760, "NCCL_SOCKET_IFNAME set by environment to ens3", tid=1771, dev=1),
        _line("ip-10-0-0-5", 1760, "NCCL_NET_GDR_LEVEL set by environment to 2.", tid=1771, dev=1),
        _line("ip-10-0-0-5", 1760, "comm 0x7f30a4000d00 rank 5 nranks 16 cudaDev 1 busId 1c0 - Init COMPLETE", 1771, 1),
        "ip-10-0-0-5:1760:1771 [1] init.cc:775 (initTransportsRank) NCCL WARN something went wrong",
        _line("ip-10-0-0-5", 1760, "cudaDriverVersion 11070"),
    ])
    log = parse_nccl_log(text, 5)
    assert (log.nccl_version, log.cuda_version, log.cuda_driver_version) == ("2.7.8", "11.0", "11.7")
    assert log.env == {"NCCL_SOCKET_IFNAME": "ens3", "NCCL_NET_GDR_LEVEL": "2"}
    assert log.warnings == ("something went wrong",) and log.hosts == ("ip-10-0-0-5",)
    comm = _comm(log)
    assert (comm.rank, comm.n_ranks, comm.bus_id, comm.comm_id, comm.init_complete) == (5, 16, "1c0", None, True)
    assert (comm.coll_channels, comm.nvls_channels) == (8, None) and comm.transports_by_peer() == {4: ("NET/Socket",)}


def _two_node_logs(env_lines: tuple[str, str]) -> list[NcclRankLog]:
    logs = []
    for rank, host in enumerate(("a", "b")):
        logs.append(parse_nccl_log("\n".join([
            _line(host, 5, env_lines[rank]),
            _line(host, 5, f"comm 0x55{rank} rank {rank} nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0"),
            _line(host, 5, f"Channel 00/0 : {rank}[0] -> {1 - rank}[0] [send] via NET/Socket/0"),
            _line(host, 5, f"ncclCommInitRank comm 0x55{rank} rank {rank} nranks 2 cudaDev 0 nvmlDev 0 busId 7000"
                  " commId 0x77 - Init COMPLETE")]), rank))
    return logs


def test_disabled_ib_and_shm_and_differing_variables():
    ib = "NCCL_IB_DISABLE set by environment to 1."
    titles = {f.title: f for f in nccl_findings(_two_node_logs((ib, ib)))}
    assert titles["InfiniBand/RoCE is disabled"].severity == "warning"
    assert "NCCL_IB_DISABLE" in titles["InfiniBand/RoCE is disabled"].advice
    assert "Inter-node traffic uses TCP sockets (NET/Socket), not InfiniBand/RoCE" in titles
    shm = nccl_findings(_two_node_logs(("NCCL_SHM_DISABLE set by environment to 1.", "x")))
    assert [(f.title, f.ranks) for f in shm if "Shared" in f.title] == [("Shared-memory transport is disabled", (0,))]
    ifnames = ("NCCL_SOCKET_IFNAME set by environment to eth0", "NCCL_SOCKET_IFNAME set by environment to ib0")
    [differ] = [f for f in nccl_findings(_two_node_logs(ifnames)) if f.title == "NCCL variables differ across ranks"]
    assert differ.ranks == (0, 1) and "'eth0' (ranks 0 on a)" in differ.detail


@pytest.mark.parametrize("text", ["", "\n\n", "garbage\x00\xff line", "h:1:2 [0] NCCL INFO", "h:1:2 [0] NCCL WARN"])
def test_empty_or_garbage_text_parses_to_an_empty_log(text):
    log = parse_nccl_log(text)
    assert log.comms == {} and log.nccl_version is None and log.env == {}


def test_fuzzed_fragments_of_real_lines_never_raise():
    pieces = [line for scenario in ("tp_across_nodes", "mixed_versions") for path in (CORPUS / scenario).glob("*.log")
              for line in path.read_text().splitlines() if line]
    rng = random.Random(0)
    for _ in range(300):
        line = rng.choice(pieces)
        a, b = sorted(rng.sample(range(len(line) + 1), 2))
        junk = line[:a] + rng.choice(["", "zz", "0xQQ", " -1", "[", "]", " - Init COMPLETE"]) + line[b:]
        parse_nccl_log("\n".join([junk, rng.choice(pieces)[::-1], junk]))
    assert rank_from_name("nccl.rank12.node-a.4242.log") == 12 and rank_from_name("nccl.node.log") is None


def test_markdown_card_has_the_three_tables():
    logs, roles = _load("tp_across_nodes"), _roles()
    card = nccl_markdown(logs, nccl_findings(logs, roles), topology_table(logs, roles))
    assert "| severity | finding | ranks | advice |" in card and "| warning | **`tp` groups cross nodes" in card
    assert "| 3 | node-b | 52312 | not logged |" in card
    assert "| 0xa7196b50ac2f8670 | tp | 0-1 | 2 | 2 | 2 | NET/IB/GDRDMA | no | 2/2 |" in card


def test_cli_finds_logs_and_layout_under_a_run_dir(tmp_path, capsys):
    shutil.copytree(CORPUS / "tp_across_nodes", tmp_path / "diagnostics" / "nccl")
    (tmp_path / "diagnostics" / "nccl" / "layout.json").rename(tmp_path / "layout.json")
    assert main(["nccl", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "WARNING: `tp` groups cross nodes" in out and f"mesh roles from {tmp_path / 'layout.json'}" in err
    assert main(["nccl", str(CORPUS / "mixed_versions")]) == 1
    assert "ERROR: NCCL versions differ across ranks" in capsys.readouterr().out


def test_cli_refuses_what_it_cannot_read(tmp_path, capsys):
    assert main(["nccl", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main(["nccl", str(tmp_path)]) == 2
    assert "no NCCL log in" in capsys.readouterr().err
    (tmp_path / "layout.json").write_text("{not json")
    assert main(["nccl", str(CORPUS / "p2p_disabled"), "--layout", str(tmp_path / "layout.json")]) == 2
    assert "cannot read mesh roles" in capsys.readouterr().err


def test_python_dash_m_diagnostics():
    done = subprocess.run([sys.executable, "-m", "diagnostics", "nccl", str(CORPUS / "single_node_nvlink")],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "No findings" in done.stdout and "P2P/CUMEM/read" in done.stdout


def _renamed(source: Path, target: Path, keep: int | None = None) -> Path:
    """The scenario's logs as ``NCCL_DEBUG_FILE=<dir>/%h.%p`` names them (host.pid, no suffix, no rank)."""
    target.mkdir()
    for path in sorted(source.glob("nccl.rank*.log"))[:keep]:
        host, pid = path.name.split(".")[2:4]
        shutil.copy(path, target / f"{host}.{pid}")
    return target


def test_logs_named_host_pid_get_their_rank_from_the_world_communicator(tmp_path):
    logs = parse_nccl_dir(_renamed(CORPUS / "socket_fallback", tmp_path / "hp"))
    assert [log.global_rank for log in logs] == [0, 1, 2, 3]
    assert [log.hosts for log in logs] == [("trainer-a",)] * 2 + [("trainer-b",)] * 2
    [finding] = nccl_findings(logs)
    card = nccl_markdown(logs, [finding], topology_table(logs))
    assert finding.ranks == (0, 1, 2, 3) and "| 0-3 |" in card and "| ? |" not in card, card
    mixed = parse_nccl_dir(_renamed(CORPUS / "mixed_versions", tmp_path / "mv"))
    assert "2.22.3 (ranks 2-3 on gpu-b); 2.23.4 (ranks 0-1 on gpu-a)" in nccl_findings(mixed)[0].detail
    assert [row["ranks"] for row in topology_table(mixed)] == [row["ranks"] for row in topology_table(_load("mixed_versions"))]


def test_a_partial_set_of_host_pid_logs_keeps_the_ranks_it_has(tmp_path):
    logs = parse_nccl_dir(_renamed(CORPUS / "multi_node_ib", tmp_path / "some", keep=5))
    assert [log.global_rank for log in logs] == [0, 1, 2, 3, 4]
    missing = [f for f in nccl_findings(logs) if f.title == "No NCCL log for some ranks"]
    assert [f.ranks for f in missing] == [(5, 6, 7)]


def test_without_one_world_communicator_the_rank_stays_unknown(tmp_path):
    folder = _renamed(CORPUS / "tp_across_nodes", tmp_path / "tp")
    assert [log.global_rank for log in parse_nccl_dir(folder)] == [0, 1, 2, 3]  # from the world communicator
    for path in folder.iterdir():  # without the world communicator: only pairs, several of the largest size
        lines = path.read_text().splitlines()
        world = next(line.split("comm ")[1].split()[0] for line in lines if " nranks 4 " in line)
        path.write_text("\n".join(line for line in lines if world not in line))
    logs = parse_nccl_dir(folder)
    assert {len(log.comms) for log in logs} == {2} and {log.global_rank for log in logs} == {None}


def test_rank_in_a_file_name_is_a_word_not_part_of_a_host_name():
    assert rank_from_name("nccl.rank3.node-a.4242.log") == 3
    assert rank_from_name("frankfurt-12.4242") is None and rank_from_name("node-rank7.log") == 7
