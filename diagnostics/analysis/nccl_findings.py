"""Findings over a run's NCCL logs: what is wrong or slow about its communicators, and how to fix it.

A communicator is one process group: its ``commId`` is the same in every member's file, so the files that share
it name the group's global ranks, which ``roles`` (``layout.json``) maps to a mesh role. Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diagnostics.records import NcclComm, NcclRankLog

Severity = Literal["error", "warning", "info"]
LATENCY_ROLES = ("tp", "cp", "ep")
"""Roles whose collectives sit on every layer's critical path: they belong inside a node."""


@dataclass(frozen=True)
class NcclFinding:
    """One thing wrong or slow about a run's communicators, as its NCCL logs show it, and its fix."""

    severity: Severity
    title: str
    detail: str
    advice: str
    """One concrete fix, naming the variable, dim or command."""
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class CommGroup:
    """One communicator across the files of its members."""

    group_id: str
    members: tuple[tuple[int | None, NcclComm, NcclRankLog], ...]
    role: str | None

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for r, _, _ in self.members if r is not None))

    @property
    def n_ranks(self) -> int | None:
        return max((c.n_ranks for _, c, _ in self.members if c.n_ranks is not None), default=None)

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(sorted({log.hosts[0] for _, _, log in self.members if log.hosts}))

    @property
    def n_nodes(self) -> int:
        return max([c.n_nodes for _, c, _ in self.members if c.n_nodes is not None] + [len(self.hosts)])

    @property
    def transports(self) -> tuple[str, ...]:
        return tuple(sorted({conn.kind for _, c, _ in self.members for conn in c.connections}))

    @property
    def uses_network(self) -> bool:
        return any(t.startswith("NET/") for t in self.transports)


def format_ranks(ranks) -> str:
    """(0, 1, 2, 5) -> "0-2, 5"."""
    ranks, spans = sorted(set(ranks)), []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "-"


def _role(ranks: tuple[int, ...], world: int | None, roles: dict[str, list[list[int]]] | None) -> str | None:
    names = [name for name, groups in (roles or {}).items() if any(sorted(g) == list(ranks) for g in groups)]
    if names:
        return ", ".join(names)
    return "world" if world and list(ranks) == list(range(world)) else None


def comm_groups(logs: list[NcclRankLog], roles: dict[str, list[list[int]]] | None = None) -> list[CommGroup]:
    """Communicators keyed by ``commId`` (or the split key), the largest first."""
    members: dict[str, list] = {}
    for log in logs:
        for comm in log.comms.values():
            key = comm.group_id or f"{log.path or log.global_rank}:{comm.pointer}"
            members.setdefault(key, []).append((log.global_rank, comm, log))
    world = max((c.n_ranks or 0 for log in logs for c in log.comms.values()), default=0)
    groups = []
    for key, found in members.items():
        found.sort(key=lambda m: (m[1].rank is None, m[1].rank or 0))
        ranks = tuple(sorted(r for r, _, _ in found if r is not None))
        role = _role(ranks, world, roles) if len(ranks) == len(found) else None
        groups.append(CommGroup(key, tuple(found), role))
    return sorted(groups, key=lambda g: (-(g.n_ranks or 0), g.ranks))


def topology_table(logs: list[NcclRankLog], roles: dict[str, list[list[int]]] | None = None) -> list[dict]:
    """One row per communicator: who is in it, which mesh role it serves, how NCCL connected it."""
    rows = []
    for g in comm_groups(logs, roles):
        rows.append({
            "communicator": g.group_id, "role": g.role, "ranks": g.ranks, "n_ranks": g.n_ranks,
            "n_nodes": g.n_nodes, "hosts": g.hosts,
            "channels": max((c.channels or 0 for _, c, _ in g.members), default=0) or None,
            "transports": g.transports, "nvls": any(c.nvls for _, c, _ in g.members),
            "init_complete": f"{sum(c.init_complete for _, c, _ in g.members)}/{g.n_ranks or len(g.members)}",
        })
    return rows


def _by_value(logs: list[NcclRankLog], value) -> dict[str, list[NcclRankLog]]:
    found: dict[str, list[NcclRankLog]] = {}
    for log in logs:
        if (v := value(log)) is not None:
            found.setdefault(v, []).append(log)
    return found


def _where(logs: list[NcclRankLog]) -> str:
    hosts = sorted({h for log in logs for h in log.hosts})
    ranks = [log.global_rank for log in logs if log.global_rank is not None]
    return f"ranks {format_ranks(ranks)} on {', '.join(hosts) or '?'}"


def _ranks(logs) -> tuple[int, ...]:
    return tuple(sorted({log.global_rank for log in logs if log.global_rank is not None}))


def _version_findings(logs: list[NcclRankLog]) -> list[NcclFinding]:
    findings = []
    versions = _by_value(logs, lambda log: log.nccl_version)
    mismatch_warned = [log for log in logs if any("Mismatched NCCL version" in w for w in log.warnings)]
    if len(versions) > 1 or mismatch_warned:
        detail = "; ".join(f"{v} ({_where(found)})" for v, found in sorted(versions.items()))
        if mismatch_warned:
            warning = next(w for w in mismatch_warned[0].warnings if "Mismatched NCCL version" in w)
            detail += f". NCCL itself stopped init: \"{warning}\""
        findings.append(NcclFinding(
            "error", "NCCL versions differ across ranks", detail,
            "Run one NCCL on every node: the same container image or torch wheel (compare"
            " `python -c \"import torch; print(torch.cuda.nccl.version())\"` on each node) and no other libnccl.so"
            " ahead of it on `LD_LIBRARY_PATH`; NCCL 2.23+ refuses mixed versions and older ones fail or hang.",
            _ranks([log for found in versions.values() for log in found] + mismatch_warned)))
    builds = _by_value(logs, lambda log: log.cuda_version)
    if len(builds) > 1 and len(versions) <= 1:
        findings.append(NcclFinding(
            "warning", "NCCL is built for different CUDA versions",
            "; ".join(f"+cuda{v} ({_where(found)})" for v, found in sorted(builds.items())),
            "Install the same torch/NCCL build (same `+cuXXX` wheel or image) on every node.",
            _ranks([log for found in builds.values() for log in found])))
    drivers = _by_value(logs, lambda log: log.cuda_driver_version)
    if len(drivers) > 1:
        findings.append(NcclFinding(
            "info", "CUDA drivers differ across ranks",
            "; ".join(f"driver CUDA {v} ({_where(found)})" for v, found in sorted(drivers.items())),
            "Install one NVIDIA driver version on every node (`nvidia-smi` shows it); mixed drivers are supported"
            " but are a common source of node-specific failures.",
            _ranks([log for found in drivers.values() for log in found])))
    return findings


def _init_findings(logs: list[NcclRankLog], groups: list[CommGroup], roles: dict | None) -> list[NcclFinding]:
    findings = []
    logged = {log.global_rank for log in logs if log.global_rank is not None}
    expected = set(range(max((g.n_ranks or 0 for g in groups), default=0)))
    expected |= {r for groups_ in (roles or {}).values() for group in groups_ for r in group}
    missing = sorted(expected - logged) if logged else []
    if missing:
        findings.append(NcclFinding(
            "error", "No NCCL log for some ranks",
            f"No log for rank(s) {format_ranks(missing)}: the logs hold ranks {format_ranks(logged)} of the run's"
            f" {len(expected)}.",
            "Check that those ranks started (their stderr), that `NCCL_DEBUG_FILE`'s folder"
            " (`<log_dir>/diagnostics/nccl`) is writable on their node, and copy every node's files into one folder.",
            tuple(missing)))
    for g in groups:
        stuck = [(r, c, log) for r, c, log in g.members if not c.init_complete]
        stuck_ranks = tuple(r for r, _, _ in stuck if r is not None)
        if stuck:
            warned = [w for _, _, log in stuck for w in log.warnings]
            done = [r for r, c, _ in g.members if c.init_complete and r is not None]
            detail = (f"Communicator {g.group_id} ({g.n_ranks} ranks{', ' + g.role if g.role else ''}): the log of"
                      f" rank(s) {format_ranks(stuck_ranks)} stops before `Init COMPLETE`"
                      f"{'; ranks ' + format_ranks(done) + ' completed' if done else ''}.")
            if warned:
                detail += f" First NCCL WARN: \"{warned[0]}\""
            findings.append(NcclFinding(
                "error", "NCCL init never completed", detail,
                "Read that rank's last log lines and stderr: init stops when a peer crashed or never started, when"
                " nodes cannot reach each other on the chosen interface (set `NCCL_SOCKET_IFNAME` to the one they"
                " share), or on the WARN shown; rerun with `NCCL_DEBUG_SUBSYS=INIT,NET` to see how far it got.",
                stuck_ranks))
        if g.n_ranks and len(g.members) < g.n_ranks and not missing:
            # Only a world-sized communicator says who is absent: a subgroup's other members are unknown.
            absent = sorted(logged - set(g.ranks)) if g.n_ranks == len(expected) else []
            findings.append(NcclFinding(
                "error", f"Communicator {g.group_id} was started by {len(g.members)} of its {g.n_ranks} ranks",
                f"Only ranks {format_ranks(g.ranks)} logged it; "
                + (f"the logs of rank(s) {format_ranks(absent)} never start it." if absent
                   else "the other members never began its init."),
                "Every member must call the same collectives on the group in the same order: look for a rank that"
                " skipped a collective (a condition on the rank) or is still stuck in an earlier one.",
                tuple(absent) or g.ranks))
    return findings


def _env_findings(logs: list[NcclRankLog], groups: list[CommGroup]) -> list[NcclFinding]:
    findings = []
    multi_node = any(g.n_nodes > 1 for g in groups) or len({h for log in logs for h in log.hosts}) > 1
    flags = {
        "NCCL_IB_DISABLE": ("warning" if multi_node else "info", "InfiniBand/RoCE is disabled",
                            "NCCL falls back to TCP sockets between nodes.",
                            "Unset `NCCL_IB_DISABLE` so NCCL can use InfiniBand/RoCE between nodes (fix the fabric"
                            " instead if it was set to work around a failing NIC)."),
        "NCCL_P2P_DISABLE": ("warning", "GPU peer-to-peer (NVLink/PCIe P2P) is disabled",
                             "GPUs of one node exchange data through host shared memory (SHM) instead.",
                             "Unset `NCCL_P2P_DISABLE`; if it was set because P2P hangs, fix the cause (IOMMU/ACS"
                             " on the PCIe switches) or keep NVLink with `NCCL_P2P_LEVEL=NVL`."),
        "NCCL_SHM_DISABLE": ("warning", "Shared-memory transport is disabled",
                             "GPUs of one node that cannot use P2P go through the network instead.",
                             "Unset `NCCL_SHM_DISABLE` (and give containers a large `/dev/shm`, e.g."
                             " `--shm-size=16g`, if that is why it was set)."),
    }
    for name, (severity, title, detail, advice) in flags.items():
        found = [log for log in logs if log.env.get(name) == "1"]
        if found:
            findings.append(NcclFinding(severity, title, f"`{name}=1` on {_where(found)}. {detail}", advice,
                                        _ranks(found)))
    differing = {}
    for name in sorted({n for log in logs for n in log.env}):
        values = _by_value(logs, lambda log, n=name: log.env.get(n))
        if len(values) > 1:
            differing[name] = values
    if differing:
        detail = "; ".join(f"`{n}`: " + ", ".join(f"{v!r} ({_where(found)})" for v, found in sorted(vals.items()))
                           for n, vals in differing.items())
        findings.append(NcclFinding(
            "warning", "NCCL variables differ across ranks", detail,
            "Export the same `NCCL_*` variables to every rank (through the launcher, not a node's shell profile).",
            _ranks([log for vals in differing.values() for found in vals.values() for log in found])))
    return findings


def _network_findings(groups: list[CommGroup]) -> list[NcclFinding]:
    findings = []
    socket = [g for g in groups if g.n_nodes > 1 and ("NET/Socket" in g.transports or (
        not g.transports and any(c.network == "Socket" for _, c, _ in g.members)))]
    if socket:
        logs = {id(log): log for g in socket for _, _, log in g.members}.values()
        no_ib = [log for log in logs if log.ib_absent]
        interfaces = sorted({i for log in logs for i in log.socket_interfaces})
        detail = (f"{len(socket)} communicator(s) spanning nodes connect over TCP sockets"
                  f" ({', '.join(interfaces) or 'interface not logged'}).")
        if no_ib:
            detail += f" NCCL found no InfiniBand device (`NET/IB : No device found`) on {_where(no_ib)}."
        findings.append(NcclFinding(
            "warning", "Inter-node traffic uses TCP sockets (NET/Socket), not InfiniBand/RoCE", detail,
            "If the nodes have IB/RoCE NICs, make them visible to NCCL (rdma-core/libibverbs in the image,"
            " `/dev/infiniband` passed into the container, `NCCL_IB_HCA` naming the HCAs; on AWS EFA install"
            " aws-ofi-nccl); if sockets are all there is, set `NCCL_SOCKET_IFNAME` to the fastest interface and"
            " keep only dp_replicate/pp across nodes.",
            tuple(sorted({r for g in socket for r in g.ranks}))))
    by_role: dict[str, list[CommGroup]] = {}
    for g in groups:
        for name in (g.role or "").split(", "):
            if name.startswith(LATENCY_ROLES) and (g.uses_network or g.n_nodes > 1):
                by_role.setdefault(name, []).append(g)
    for name, found in by_role.items():
        spans = "; ".join(f"ranks {format_ranks(g.ranks)} on {', '.join(g.hosts)} via {', '.join(g.transports)}"
                          for g in found)
        findings.append(NcclFinding(
            "warning", f"`{name}` groups cross nodes: their collectives go over the network", spans,
            f"Keep `{name}` inside a node: make it the innermost mesh dim with {name} <= GPUs per node"
            " (`LOCAL_WORLD_SIZE`), and launch so consecutive global ranks share a node (torchrun's default; SLURM"
            " `--distribution=block`); move the rest to dp_shard or pp.",
            tuple(sorted({r for g in found for r in g.ranks}))))
    return findings


def nccl_findings(logs: list[NcclRankLog], roles: dict[str, list[list[int]]] | None = None) -> list[NcclFinding]:
    """Everything worth acting on, errors first."""
    groups = comm_groups(logs, roles)
    findings = (_version_findings(logs) + _init_findings(logs, groups, roles) + _env_findings(logs, groups)
                + _network_findings(groups))
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(findings, key=lambda f: order[f.severity])
