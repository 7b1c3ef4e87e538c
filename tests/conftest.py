"""Two pytest workers share the machine (``-n 2 --dist loadgroup`` in pyproject's addopts), so the cores a launch
leaves idle (ranks waiting for a timeout, one rank computing the reference) do not stay idle:

- the tests that train on several processes are one unit, run by one worker in `GROUP`'s order: the training
  tests first, the live diagnostics that judge timings (a straggler, a data-bound loader, the peak memory of a
  re-run) last;
- the other worker takes the fault tests that mostly wait (`WAITING`: a rank stuck or killed, its peers stopping
  within the timeout) and the end-to-end runs (`BESIDE`: the README's job, the Hydra runs), each module a unit,
  then the in-process tests one by one (xdist hands out the units with more tests first).

A launch beside the group's slows both (their ranks wait on each other's time slices), but the group alone kept
about one core busy (105% of two over a 1188 s suite, the other worker idle after its first 500 s), so the
end-to-end module, 184 s of the group's time, runs beside it: handed out early (it has more tests than the other
units), it is expected to end long before the group's timing tests. The grouping is by path, in the scheduler
below: pytest-xdist's ``xdist_group`` marker does not group under pytest 9 (xdist 3.8 sets ``item._nodeid``, which
pytest 9 no longer reads)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

GROUP = ("tests/distributed/", "tests/diagnostics/test_memory_live.py",
         "tests/diagnostics/test_bottleneck_live.py")
WAITING = ("tests/diagnostics/test_hang_live.py", "tests/distributed/test_failures.py")
BESIDE = ("tests/e2e/",)
ROOT = Path(__file__).resolve().parents[1]


def place(path: str) -> tuple[int, int]:
    """(0, index in `GROUP`) for the group, (1, 0) for an in-process test, (2, 0) for a module of its own."""
    if path.startswith(WAITING + BESIDE):
        return 2, 0
    index = next((i for i, prefix in enumerate(GROUP) if path.startswith(prefix)), None)
    return (1, 0) if index is None else (0, index)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: place(Path(str(item.path)).resolve().relative_to(ROOT).as_posix()))


class GroupScheduling(LoadScopeScheduling):
    """The group is one work unit (the biggest, so handed out first); a waiting or end-to-end module is one; every
    other test is a unit of its own."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        kind, _ = place(path)
        return "group" if kind == 0 else path if kind == 2 else nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log) -> LoadScopeScheduling | None:
    return GroupScheduling(config, log) if config.getvalue("dist") == "loadgroup" else None


SUITE_BUDGET = "LIGHTNING_ND_SUITE_BUDGET"
"""Seconds after which no more tests start (default 3600): each one left fails at once, naming the budget, so a
suite slowed by a loaded machine or a hang still ends with its summary inside CI's limit (90 minutes, the install
and `timeout` in pyproject.toml for the test running at the budget included)."""
_started = time.monotonic()


def pytest_runtest_setup(item: pytest.Item) -> None:
    budget = float(os.environ.get(SUITE_BUDGET, "3600"))
    if time.monotonic() - _started > budget:
        pytest.fail(f"not run: the suite has run for more than its {budget:.0f} s budget ({SUITE_BUDGET}); see the"
                    " slowest durations below", pytrace=False)


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """After each test, no default process group. A Trainer run in the test's own process (``devices=1``) starts a
    one-process group that Lightning leaves up when it ends, as it does for its own strategies; every later test of
    that worker would see it (test_errors checks that a refusal starts none, and a test starting its own fails)."""
    yield
    dist = sys.modules.get("torch.distributed")  # not imported: no group
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
