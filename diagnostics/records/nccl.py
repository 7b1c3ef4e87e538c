"""What one process's NCCL ``NCCL_DEBUG=INFO`` log says, as frozen records: versions, communicators, their
channel connections and transports, the ``NCCL_*`` variables (read by `diagnostics.analysis.nccl_log`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Connection:
    """One channel connection a rank logged, in communicator ranks (this rank is always one end)."""

    channel: int
    src: int
    dst: int
    transport: str
    """As logged: ``P2P/CUMEM/read``, ``SHM/direct/direct``, ``NET/IB/0/GDRDMA``, ``NET/Socket/0``..."""

    @property
    def kind(self) -> str:
        """The transport without device numbers: ``NET/IB/GDRDMA``, ``NET/Socket``, ``P2P/CUMEM/read``, ``SHM``."""
        parts = self.transport.split("/")
        if parts[0] == "NET":
            gdr = ["GDRDMA"] if "/GDRDMA" in self.transport else []
            return "/".join(["NET", parts[1] if len(parts) > 1 else "?", *gdr])
        if parts[0] == "SHM":
            return "SHM"
        return "/".join(p for p in parts if not re.match(r"^\d+(\[\d+\])?$", p))

    @property
    def is_network(self) -> bool:
        return self.transport.startswith("NET/")


@dataclass(frozen=True)
class NcclComm:
    """One communicator as one rank saw it."""

    pointer: str
    rank: int | None = None
    n_ranks: int | None = None
    n_nodes: int | None = None
    local_ranks: int | None = None
    cuda_dev: int | None = None
    bus_id: str | None = None
    comm_id: str | None = None
    """The same in every member's file: NCCL hashes the unique id all members were given."""
    group_id: str | None = None
    """``comm_id``, or for a split without one (2.23+) the parent's group id, the colour and the size."""
    init_complete: bool = False
    coll_channels: int | None = None
    nvls_channels: int | None = None
    p2p_channels: int | None = None
    p2p_channels_per_peer: int | None = None
    network: str | None = None
    nvls_support: bool | None = None
    nvls_comm: bool = False
    connections: tuple[Connection, ...] = ()
    rings: tuple[tuple[int, ...], ...] = ()
    trees: tuple[str, ...] = ()
    """Per channel, ``down0/down1/down2->rank->up`` (``Trees [0] 1/-1/-1->0->-1 ...``)."""

    @property
    def channels(self) -> int | None:
        """``coll channels`` from the summary line, else what the ring or Channel lines show."""
        if self.coll_channels is not None:
            return self.coll_channels
        seen = {c.channel for c in self.connections} | set(range(len(self.rings)))
        return len(seen) or None

    @property
    def nvls(self) -> bool:
        return bool(self.nvls_channels) or self.nvls_comm

    def transports_by_peer(self) -> dict[int, tuple[str, ...]]:
        """Peer communicator rank -> the transport kinds this rank uses with it."""
        peers: dict[int, set[str]] = {}
        for c in self.connections:
            peer = c.dst if c.src == self.rank else c.src
            peers.setdefault(peer, set()).add(c.kind)
        return {peer: tuple(sorted(kinds)) for peer, kinds in sorted(peers.items())}


@dataclass(frozen=True)
class NcclRankLog:
    """What one process's NCCL log says."""

    global_rank: int | None = None
    path: str | None = None
    hosts: tuple[str, ...] = ()
    pids: tuple[int, ...] = ()
    nccl_version: str | None = None
    """NCCL <= 2.21 logs it only in a process that is rank 0 of some communicator; None elsewhere."""
    cuda_version: str | None = None
    """The CUDA NCCL was built for (``+cuda12.4``)."""
    cuda_driver_version: str | None = None
    networks: tuple[str, ...] = ()
    ib_devices: tuple[str, ...] = ()
    ib_absent: bool = False
    socket_interfaces: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    comms: dict[str, NcclComm] = field(default_factory=dict)
    """By communicator pointer, in the order their init started."""
    warnings: tuple[str, ...] = ()
