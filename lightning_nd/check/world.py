"""`FakeWorld`: the ranks of a layout as threads of one CPU process, each with torch's fake process group.

torch's fake process group (``backend="fake"``) lets one process act as any rank of any world: collectives return
at once and move no data, so a rank's setup and step run as on the cluster while tensors stay fake
(``FakeTensorMode``: shapes, dtypes and placements, no storage). What a fake group cannot do is deliver the few
Python objects ranks send each other; torch's pipeline stages need them (each stage learns its input and gradient
shapes from its neighbours before the first step; torch >= 2.13 asks every rank of a fake world for them and cannot
get them, pytorch/pytorch#191538). So each checked rank runs in its own thread, with its own default group
(torch's ``ThreadLocalWorld``), and this world delivers what those ranks send as objects (`send_object_list`,
`recv_object_list`, `broadcast_object_list`) from thread to thread. The threads take turns: one runs until it waits
for an object, so a rank's work is never interleaved with another's except at a wait, and when every rank still
running waits, none can go on: that is a hang, reported with who waits for whom.

The pipeline schedule's warm-up vote (int tensors sent stage to stage, whose values a fake group never delivers,
read with ``.item()``) runs on real tensors: every stage then votes for metadata inference, as torch decides for a
fake group upstream.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.pipelining import schedules
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

GROUP_NAMES_PER_RANK = 1_000_000
"""Process group names are one registry per process: each rank's groups are numbered from its own offset."""


class Hang(RuntimeError):
    """Every rank still running waits for an object no rank will send."""


class PeerFailed(RuntimeError):
    """The rank this one waits for failed first (its own error is the one reported)."""


class FakeWorld:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._turn = threading.Condition(threading.RLock())
        self._boxes: dict[tuple[int, int, str], deque[list[Any]]] = defaultdict(deque)
        self._waits: dict[int, tuple[int, str]] = {}  # rank -> the rank and channel it waits on
        self._live = 0
        self._names: list[str] = []
        self.waited: dict[int, float] = defaultdict(float)
        """Seconds each rank spent waiting for others (its own time is its wall time less this)."""
        self.failed: set[int] = set()
        self.hang: str | None = None

    # ---- the ranks ---------------------------------------------------------------------------------

    def run(self, ranks: list[int], body: Callable[[int], None]) -> None:
        """``body(rank)`` for every rank, each in its own thread as that rank, taking turns; returns when all ended."""
        with self._patched():
            threads = [threading.Thread(target=self._as_rank, args=(rank, body), name=f"rank {rank}", daemon=True)
                       for rank in ranks]
            self._live = len(threads)
            try:
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            finally:
                for name in self._names:
                    dist.distributed_c10d._unregister_process_group(name)

    def _as_rank(self, rank: int, body: Callable[[int], None]) -> None:
        with self._turn:
            try:
                dist.distributed_c10d._world.group_count = GROUP_NAMES_PER_RANK * (rank + 1)
                dist.init_process_group("fake", rank=rank, world_size=self.world_size, store=FakeStore())
                body(rank)
            except BaseException:  # ``body`` keeps what it needs of its error; the ranks waiting for this one stop
                self.failed.add(rank)
            finally:  # its groups stay registered until every rank ended: the registry of names is the process's
                self._names += list(dist.distributed_c10d._world.pg_names.values())
                self._live -= 1
                self._turn.notify_all()

    # ---- objects between ranks ---------------------------------------------------------------------

    def send(self, objects: list[Any], dst: int, channel: str = "p2p") -> None:
        """``channel``: point-to-point, or a broadcast over one group (each its own order, as on a real network)."""
        with self._turn:
            self._boxes[(dist.get_rank(), dst, channel)].append(list(objects))
            self._turn.notify_all()

    def receive(self, objects: list[Any], src: int, channel: str = "p2p") -> None:
        me = dist.get_rank()
        box = self._boxes[(src, me, channel)]
        start = time.perf_counter()
        with self._turn:
            self._waits[me] = (src, channel)
            try:
                while not box:
                    if self.hang is None and src in self.failed:
                        raise PeerFailed(f"rank {src} failed before sending to rank {me}")
                    if self.hang is None and self._stuck():
                        self.hang = "; ".join(f"rank {r} waits for rank {peer}"
                                              for r, (peer, _) in sorted(self._waits.items()))
                        self._turn.notify_all()
                    if self.hang is not None:
                        raise Hang(f"No rank can go on: {self.hang}.")
                    self._turn.wait()
            finally:
                del self._waits[me]
                self.waited[me] += time.perf_counter() - start
            objects[:] = box.popleft()

    def _stuck(self) -> bool:
        """Every rank still running waits, and none has what it waits for (woken, it has not taken it yet)."""
        return len(self._waits) == self._live and not any(
            self._boxes[(src, rank, channel)] or src in self.failed for rank, (src, channel) in self._waits.items())

    @contextmanager
    def _patched(self) -> Iterator[None]:
        """torch's object collectives delivered by this world, one default group per thread, the vote on real
        tensors, and no fake-tensor dispatch cache (the check dispatches each shape a few times; filling the cache
        costs more than it saves: 46 s instead of 61 s for a 70B Llama's four stages)."""
        import torch._dynamo.config as dynamo_config

        def send_object_list(objects: list[Any], dst: int | None = None, group: Any = None, device: Any = None,
                             group_dst: int | None = None, **_: Any) -> None:
            self.send(objects, dist.get_global_rank(group, group_dst) if dst is None else dst)

        def recv_object_list(objects: list[Any], src: int | None = None, group: Any = None, device: Any = None,
                             group_src: int | None = None, **_: Any) -> int:
            source = dist.get_global_rank(group, group_src) if src is None else src
            self.receive(objects, source)
            return source

        def broadcast_object_list(objects: list[Any], src: int | None = None, group: Any = None, device: Any = None,
                                  group_src: int | None = None) -> None:
            source = dist.get_global_rank(group, group_src) if src is None else src
            members = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
            channel = f"broadcast {members}"
            if dist.get_rank() == source:
                for rank in members:
                    if rank != source:
                        self.send(objects, rank, channel)
            else:
                self.receive(objects, source, channel)

        votes = [cls for cls in vars(schedules).values() if isinstance(cls, type) and "_warmup_p2p" in vars(cls)]
        saved_votes = {cls: vars(cls)["_warmup_p2p"] for cls in votes}
        saved = (dist.distributed_c10d._world, dist.send_object_list, dist.recv_object_list,
                 dist.broadcast_object_list, dynamo_config.fake_tensor_cache_enabled)
        dist.distributed_c10d._world = ThreadLocalWorld()
        dist.send_object_list, dist.recv_object_list = send_object_list, recv_object_list  # type: ignore[assignment]
        dist.broadcast_object_list = broadcast_object_list  # type: ignore[assignment]
        dynamo_config.fake_tensor_cache_enabled = False
        for cls, vote in saved_votes.items():
            cls._warmup_p2p = _on_real_tensors(vote)  # type: ignore[attr-defined]
        try:
            yield
        finally:
            (dist.distributed_c10d._world, dist.send_object_list, dist.recv_object_list, dist.broadcast_object_list,
             dynamo_config.fake_tensor_cache_enabled) = saved
            for cls, vote in saved_votes.items():
                cls._warmup_p2p = vote  # type: ignore[attr-defined]


def _on_real_tensors(function: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return function(*args, **kwargs)

    return run

