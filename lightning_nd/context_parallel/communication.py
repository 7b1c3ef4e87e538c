"""The collectives of context parallelism: a ring hop (this rank's tensor to the next cp rank, the previous rank's
to this one, posted before a block computes and waited for after it) and the small all-gather of every rank's
positions. Ring attention's autograd function (`ring_attention.py`) runs its forward and backward over them:

    hop = RingHop(group, kv, report, KV_TAG)   # posted: travels while this rank computes its block
    kv = hop.wait()                            # the previous rank's K/V

gloo on CPU and NCCL on GPU alike; gloo sends and receives contiguous buffers only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import ProcessGroup

from lightning_nd.runtime.profiling import comm_label


class RingHop:
    """One ring hop in flight: its requests and buffers (kept alive until the hop is waited for)."""

    def __init__(self, group: ProcessGroup, tensor: torch.Tensor, report: Callable[[str, dict], None] | None,
                 tag: int) -> None:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.report = report
        self.peers = (dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size))
        self.sending = tensor.contiguous()  # gloo sends and receives contiguous buffers only
        self.received = torch.empty_like(self.sending)
        with comm_label("cp", "ring_post"):
            self.requests = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, self.sending, self.peers[0], group, tag),
                dist.P2POp(dist.irecv, self.received, self.peers[1], group, tag),
            ])
        self._tell("issued")

    def wait(self) -> torch.Tensor:
        """The tensor from the previous rank."""
        with comm_label("cp", "ring_wait"):
            for request in self.requests:
                request.wait()
        self._tell("completed")
        return self.received

    def _tell(self, state: str) -> None:
        """Report the send and the receive to whoever listens (the flight recorder does not record p2p on gloo)."""
        if self.report is not None:
            size = self.sending.numel() * self.sending.element_size()
            for op, peer in zip(("send", "recv"), self.peers):
                self.report("p2p", {"op": op, "peer": peer, "bytes": size, "state": state,
                                    "time_s": time.perf_counter()})


KV_TAG, GRAD_TAG = 0, 1  # K/V going round (forward, and again in backward); their gradients following them


def gather_positions(positions: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every rank's positions, concatenated in group-rank order (a small integer all-gather)."""
    gathered = [torch.empty_like(positions) for _ in range(dist.get_world_size(group))]
    with comm_label("cp", "positions"):
        dist.all_gather(gathered, positions.contiguous(), group=group)
    return torch.cat(gathered)
