"""Parse NCCL ``NCCL_DEBUG=INFO`` log files into `diagnostics.records.nccl` records: versions, communicators,
transports, variables.

The line shapes come from NCCL's own format strings (``src/debug.cc``: ``host:pid:tid [cudaDev] NCCL INFO ...``;
``src/init.cc``, ``src/transport/{p2p,shm,net}.cc``, ``src/graph/rings.cc``, ``src/misc/param.cc``) across
2.18 to 2.2x. Only a communicator's Init and Channel lines say which communicator they belong to by pointer,
so the other lines are tied to one by the thread that logged them (NCCL runs one init per thread). Pure: stdlib only.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from diagnostics.records.nccl import Connection, NcclComm, NcclRankLog

# Anything before the host (a launcher's "[1,5]<stdout>:" or a timestamp) is skipped by `search`. Every pattern runs
# in time linear in the line (a host starts only where a word does, no lazy group before an open-ended tail), and
# numbers have at most 10 digits (ranks and sizes 6): a line crafted to be long or to name a huge world costs nothing.
_PREFIX = re.compile(r"(?<![^\s:])(?P<host>[^\s:]*):(?P<pid>\d{1,10}):(?P<tid>\d{1,20}) \[(?P<dev>\d{1,10})\]"
                     r"(?: \S+)*? NCCL (?P<level>INFO|WARN) ?")
_VERSION = re.compile(r"NCCL version (\d{1,4}\.\d{1,4}\.\d{1,4})\S*?(?:\+cuda(\d{1,4}\.\d{1,4}))?\s*$")
_DRIVER = re.compile(r"(?:cudaDriverVersion|CUDA Driver version) (\d{1,10})")
# "[Rank 0] ncclCommInitRank comm 0x.. rank 0 nranks 8 cudaDev 0 nvmlDev 0 busId 18000 commId 0x.. - Init START"
_INIT = re.compile(r"comm (0x[0-9a-fA-F]{1,32}) rank (\d{1,6}) nranks (\d{1,6})(?P<rest>[^-]{0,512})-\s*Init (START|COMPLETE)")
_INIT_FIELD = re.compile(r"\b(cudaDev|color|childCount) (-?\d{1,10})\b|\b(busId|commId|parent) ((?:0x)?[0-9a-fA-F]{1,32})\b")
_COMM_SHAPE = re.compile(r"comm (0x[0-9a-fA-F]{1,32}) rank (\d{1,6}) nRanks (\d{1,6}) nNodes (\d{1,6}) localRanks"
                         r" (\d{1,6})")
_CHANNELS = re.compile(r"(\d{1,6}) coll channels, (?:\d{1,6} collnet channels, )?(?:(\d{1,6}) nvls channels, )?"
                       r"(\d{1,6}) p2p channels, (\d{1,6}) p2p channels per peer")
# "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read", "Channel 01 : 2[c7000] -> 0[87000] [receive] via NET/IB/5/GDRDMA"
_CONNECTION = re.compile(r"Channel (\d{1,6})(?:/(\d{1,6}))? : (\d{1,6})\[[^\]]*\] -> (\d{1,6})\[[^\]]*\]"
                         r"(?: \[(send|receive)\])? via (\S+)")
_RING = re.compile(r"Channel (\d{1,6})/(\d{1,6}) :((?:\s+\d{1,6})+)\s*$")
_TREES = re.compile(r"^Trees((?: \[\d{1,6}\] \S+)+)")
_NVLS_SUPPORT = re.compile(r"NVLS multicast support is (not )?available")
_NVLS_COMM = re.compile(r"NVLS comm (0x[0-9a-fA-F]{1,32})")
_NETWORK = re.compile(r"^Using network (\S.*)$")
_ENV = re.compile(r"^(NCCL_[A-Z0-9_]{1,64}) set (?:by environment )?to (.*)$")
MAX_LINE = 1 << 16
"""A longer line is cut there: no line NCCL writes comes near it."""
_INTERFACES = re.compile(r"\[\d+\](\S+)")


def _driver(code: str) -> str:
    major, rest = divmod(int(code), 1000)
    return f"{major}.{rest // 10}"


class _Builder:
    """Accumulates one file; comm-level facts wait per thread until a line names their communicator."""

    def __init__(self) -> None:
        self.log: dict = {"hosts": [], "pids": [], "networks": [], "ib_devices": [], "socket_interfaces": [],
                          "env": {}, "warnings": [], "ib_absent": False}
        self.comms: dict[str, dict] = {}
        self.open: dict[str, str] = {}
        self.last: dict[str, str] = {}
        self.pending: dict[str, list[tuple[str, object]]] = {}

    def comm(self, pointer: str, tid: str) -> dict:
        comm = self.comms.setdefault(pointer, {"pointer": pointer, "connections": [], "rings": []})
        self.open[tid] = self.last[tid] = pointer
        for key, value in self.pending.pop(tid, []):
            self.put(comm, key, value)
        return comm

    @staticmethod
    def put(comm: dict, key: str, value: object) -> None:
        if key in ("connections", "rings"):
            comm[key].append(value)
        else:
            comm[key] = value

    def fact(self, tid: str, key: str, value: object) -> None:
        pointer = self.open.get(tid)
        if pointer is None and key == "connections" and tid in self.last:
            pointer = self.last[tid]  # lazily connected p2p channels log after their communicator's init
        if pointer is None:
            self.pending.setdefault(tid, []).append((key, value))
        else:
            self.put(self.comms[pointer], key, value)

    def line(self, host: str, pid: int, tid: str, level: str, msg: str) -> None:
        for key, value in (("hosts", host), ("pids", pid)):
            if value not in self.log[key]:
                self.log[key].append(value)
        if level == "WARN":
            self.log["warnings"].append(msg.strip())
            return
        if m := _INIT.search(msg):
            fields = {a or b: x or y for a, x, b, y in _INIT_FIELD.findall(m["rest"].strip())}
            comm = self.comm(m[1], tid)
            comm.update(rank=int(m[2]), n_ranks=int(m[3]))
            for name, key in (("cudaDev", "cuda_dev"), ("busId", "bus_id"), ("commId", "comm_id"),
                              ("parent", "parent"), ("color", "color"), ("childCount", "child_count")):
                if name in fields:
                    comm[key] = int(fields[name]) if key == "cuda_dev" else fields[name]
            if m[5] == "COMPLETE":
                comm["init_complete"] = True
                self.open.pop(tid, None)
        elif m := _COMM_SHAPE.search(msg):
            comm = self.comm(m[1], tid)
            comm.update(rank=int(m[2]), n_ranks=int(m[3]), n_nodes=int(m[4]), local_ranks=int(m[5]))
        elif m := _CONNECTION.search(msg):
            self.fact(tid, "connections", Connection(int(m[1]), int(m[3]), int(m[4]), m[6]))
        elif m := _RING.search(msg):
            self.fact(tid, "rings", tuple(int(r) for r in m[3].split()))
        elif m := _TREES.search(msg):
            self.fact(tid, "trees", tuple(re.findall(r"\] (\S+)", m[1])))
        elif m := _CHANNELS.search(msg):
            self.fact(tid, "coll_channels", int(m[1]))
            self.fact(tid, "nvls_channels", int(m[2]) if m[2] is not None else None)
            self.fact(tid, "p2p_channels", int(m[3]))
            self.fact(tid, "p2p_channels_per_peer", int(m[4]))
        elif m := _NVLS_COMM.search(msg):
            self.comm(m[1], tid)["nvls_comm"] = True
        elif m := _NVLS_SUPPORT.search(msg):
            self.fact(tid, "nvls_support", m[1] is None)
        elif m := _NETWORK.search(msg):
            network = m[1].rstrip()
            self.fact(tid, "network", network)
            if network not in self.log["networks"]:
                self.log["networks"].append(network)
        elif m := _VERSION.search(msg):
            self.log["nccl_version"], self.log["cuda_version"] = m[1], m[2]
        elif m := _DRIVER.search(msg):
            self.log["cuda_driver_version"] = _driver(m[1])
        elif m := _ENV.search(msg):
            given = m[2].rstrip()
            value = given[:-1] if re.fullmatch(r"-?\d+\.", given) else given  # misc/param.cc prints "%lld."
            self.log["env"][m[1]] = value
        elif msg.startswith("NET/IB : No device found"):
            self.log["ib_absent"] = True
        elif msg.startswith("NET/IB : Using"):
            self.log["ib_devices"] = _INTERFACES.findall(msg.split(";")[0])
        elif msg.startswith("NET/Socket : Using"):
            self.log["socket_interfaces"] = _INTERFACES.findall(msg)

    def freeze(self, global_rank: int | None, path: str | None) -> NcclRankLog:
        comms = {}
        for pointer, values in self.comms.items():
            values = dict(values)
            parent, color = values.pop("parent", None), values.pop("color", None)
            child_count = values.pop("child_count", None)
            comm_id = values.get("comm_id")
            if comm_id is not None and int(comm_id, 16) != 0:
                values["group_id"] = comm_id
            elif parent in comms and comms[parent].group_id is not None:
                count = f"/{child_count}" if child_count is not None else ""
                values["group_id"] = f"{comms[parent].group_id}/split{count}:color{color}:n{values.get('n_ranks')}"
            for key in ("connections", "rings"):
                values[key] = tuple(values[key])
            comms[pointer] = NcclComm(**values)
        log = self.log
        return NcclRankLog(
            global_rank=global_rank, path=path, hosts=tuple(log["hosts"]), pids=tuple(log["pids"]),
            nccl_version=log.get("nccl_version"), cuda_version=log.get("cuda_version"),
            cuda_driver_version=log.get("cuda_driver_version"), networks=tuple(log["networks"]),
            ib_devices=tuple(log["ib_devices"]), ib_absent=log["ib_absent"],
            socket_interfaces=tuple(log["socket_interfaces"]), env=dict(log["env"]), comms=comms,
            warnings=tuple(log["warnings"]))


def parse_nccl_log(text: str, global_rank: int | None = None, path: str | None = None) -> NcclRankLog:
    """Parse one process's NCCL log text; lines NCCL did not write, or that this does not know, are skipped."""
    builder = _Builder()
    for raw in text.splitlines():
        raw = raw[:MAX_LINE]
        prefix = _PREFIX.search(raw)
        if prefix is None:
            # NCCL <= 2.21 prints a bare "NCCL version ..." to stdout, which some launchers merge in.
            if m := _VERSION.search(raw):
                builder.log["nccl_version"], builder.log["cuda_version"] = m[1], m[2]
            continue
        builder.line(prefix["host"], int(prefix["pid"]), prefix["tid"], prefix["level"], raw[prefix.end():])
    return builder.freeze(global_rank, path)


def rank_from_name(name: str) -> int | None:
    """``nccl.rank3.node-a.4242.log`` -> 3 (the name the diagnostics callback gives ``NCCL_DEBUG_FILE``)."""
    m = re.search(r"(?:^|[._-])rank(\d+)(?=$|[._-])", name)
    return int(m[1]) if m else None


HEAD_BYTES = 1 << 16
"""How much of a file not named ``nccl*.log`` is read to tell an NCCL log: NCCL's first lines come at its start."""


def _is_nccl_log(path: Path) -> bool:
    if path.name.startswith("nccl") and path.suffix == ".log":
        return True
    with open(path, "rb") as file:
        head = file.read(HEAD_BYTES)
    return b"NCCL INFO" in head or b"NCCL WARN" in head


def nccl_log_files(folder: str | Path, *, recursive: bool = False) -> list[Path]:
    """Every NCCL log in ``folder``: ``nccl*.log``, and any other file with an NCCL line in its first 64 KiB,
    whatever its name (``NCCL_DEBUG_FILE=/logs/%h.%p`` writes ``host.pid``, no suffix)."""
    folder = Path(folder)
    candidates = sorted(folder.rglob("*") if recursive else folder.iterdir())
    return [path for path in candidates if path.is_file() and _is_nccl_log(path)]


def world_ranks(logs: list[NcclRankLog]) -> list[NcclRankLog]:
    """Each log whose file name did not say its global rank, with the rank its world communicator gives: the one
    communicator (one ``commId``) of the largest size that every log with an initialised communicator belongs to.
    When no communicator is that (only sub-groups logged, or two of the largest size), the rank stays unknown."""
    members = [log for log in logs if log.comms]
    largest = max((comm.n_ranks or 0 for log in members for comm in log.comms.values()), default=0)
    worlds = {comm.comm_id for log in members for comm in log.comms.values() if comm.n_ranks == largest}
    if not largest or len(worlds) != 1 or None in worlds:
        return logs
    (world,) = worlds

    def rank_in_world(log: NcclRankLog) -> int | None:
        return next((comm.rank for comm in log.comms.values() if comm.comm_id == world), None)

    if any(rank_in_world(log) is None for log in members):
        return logs
    return [log if log.global_rank is not None or not log.comms else replace(log, global_rank=rank_in_world(log))
            for log in logs]


def parse_nccl_dir(folder: str | Path, *, recursive: bool = False) -> list[NcclRankLog]:
    """Parse every NCCL log in ``folder``, sorted by global rank (from the file's name, else from its world
    communicator: `world_ranks`; files with neither last)."""
    logs = world_ranks([parse_nccl_log(p.read_text(errors="replace"), rank_from_name(p.name), str(p))
                        for p in nccl_log_files(folder, recursive=recursive)])
    return sorted(logs, key=lambda log: (log.global_rank is None, log.global_rank or 0, log.path or ""))
