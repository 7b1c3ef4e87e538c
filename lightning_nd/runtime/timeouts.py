"""Process-group timeouts: the three knobs checked before any process group, and switching every group's
timeout at once (torch keeps one per group)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

STEP_TIMEOUT, INIT_TIMEOUT, HEARTBEAT_TIMEOUT = timedelta(minutes=5), timedelta(minutes=20), timedelta(seconds=60)
"""`NDParallel`'s timeouts when not given: a collective's, the first step's (compilation, loading), the watchdog's."""
DEFAULTS: dict[str, timedelta | None] = {
    "timeout": STEP_TIMEOUT, "init_timeout": INIT_TIMEOUT, "heartbeat_timeout": HEARTBEAT_TIMEOUT,
}


def check_timeouts(timeout: Any, init_timeout: Any, heartbeat_timeout: Any) -> tuple[timedelta, timedelta, timedelta | None]:
    """The three as ``timedelta`` (numbers are seconds, as a Hydra config gives them); refused when not positive."""
    checked: list[timedelta | None] = []
    for name, value in (("timeout", timeout), ("init_timeout", init_timeout), ("heartbeat_timeout", heartbeat_timeout)):
        if value is None and name == "heartbeat_timeout":
            checked.append(None)
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = timedelta(seconds=value)
        if not isinstance(value, timedelta) or value.total_seconds() < (2 if name == "heartbeat_timeout" else 1):
            raise ValueError(f"`NDParallel({name}={value!r})` must be a `datetime.timedelta` or seconds, at least"
                             f" {2 if name == 'heartbeat_timeout' else 1} s. HINT: e.g. `{name}=timedelta(minutes=5)`"
                             f"{' or None to turn the watchdog off' if name == 'heartbeat_timeout' else ''}.")
        checked.append(value)
    assert checked[0] is not None and checked[1] is not None, "only heartbeat_timeout may be None"
    return checked[0], checked[1], checked[2]


def set_timeout(timeout: timedelta) -> None:
    """Every process group of this process (the world and the mesh's) waits at most ``timeout``."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    for group in list(_world.pg_map):
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            _set_pg_timeout(timeout, group)
