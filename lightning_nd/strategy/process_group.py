"""The default process group of one generation of a job, on a store that a restart does not share.

torchrun keeps its agent's store across ``--max-restarts`` (and SLURM's requeue may reuse a port's store), and the
backends exchange their addresses through it: a restarted generation can read the address a dead process of the
previous one wrote, and fail ("Gloo connectFullMesh failed ... Connection refused") or wait at "Initializing
distributed". So the group is started on the launcher's store under a prefix naming the restart round
(`lightning_nd.runtime.job`), as torch's own dynamic rendezvous prefixes each round; everything else kept in the store
(the watchdog, the monitors) inherits the prefix.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection

from lightning_nd.runtime.job import store_prefix


def start_default_group(environment: ClusterEnvironment, backend: str, timeout: timedelta, **kwargs: Any) -> None:
    """`init_process_group` as Lightning starts it (its log line, its address and port), on this round's keys."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ["MASTER_ADDR"] = environment.main_address
    os.environ["MASTER_PORT"] = str(environment.main_port)
    rank, world_size = environment.global_rank(), environment.world_size()
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    generation = dist.PrefixStore(store_prefix("generation"), store)
    _init_dist_connection(environment, backend, rank, world_size, store=generation, timeout=timeout, **kwargs)
