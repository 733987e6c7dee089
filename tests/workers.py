"""How the suite spreads over pytest-xdist workers (`-n auto --dist loadscope` in pyproject.toml; a plugin of
tests/conftest.py).

Most of the suite waits (a Prefect server starting, torchrun's interpreters importing torch, a stop's grace period)
rather than computes, so more workers than CI's 2 cores pay; but not many more: every process a worker starts
competes for the same two cores and their caches, and an import-bound process (a `tuneline` command, a torchrun
worker) then takes up to twice the CPU-seconds it takes alone. Measured on 2 cores, the whole suite: 4 workers
2,932 CPU-s in 27 min 13 s, 3 workers 2,744 CPU-s in 24 min 33 s (WORKERS). Nor did fewer pay, on a later
suite (two runs back to back): 2 workers 2,006 s and 3,608 CPU-s, 3 workers 1,777 s and 3,393 CPU-s; this machine's
speed moved by as much between runs, so that pair shows no gain from 2, not a loss.

Each test runs in a group, and a group runs whole on one worker: tests marked `@pytest.mark.group(NAME)` form
group NAME (a long module split over several workers); the tests reading one of the session fixtures in SHARED
form one group, so that fixture is built once; every other test is grouped with its module, so module fixtures
(upstream caches, a server) are built once as in a run without workers. The groups in LONGEST start first, so
none starts last and runs on alone.

xdist's own `loadgroup` cannot carry these groups (it renames the test ids, which pytest 9 ignores): each worker
writes the groups of its collection to a file named after the controller's pid, which the controller's scheduler
reads once every worker has collected (they collect the same tests, in the same order).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

WORKERS = 3
SHARED = {"demo_run": "demo", "kill_walk": "prepared", "prepared": "prepared"}
LONGEST = (
    "matrix-0",
    "matrix-1",
    "matrix-2",
    "prepared",
    "demo",
    "run-column-0",
    "run-column-1",
    "tests/integration/test_ddp_train.py",
    "tests/integration/test_multinode.py",
    "tests/reliability/test_cli_server.py",
)


def _groups_file(controller_pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"tuneline-test-groups-{controller_pid}.json"


def _group(item: pytest.Item) -> str:
    """A test's group: its `group` marker's, else the shared fixture's it reads, else its module's."""
    if (marker := item.get_closest_marker("group")) is not None:
        return marker.args[0]
    shared = [SHARED[f] for f in item.fixturenames if f in SHARED]
    return shared[0] if shared else item.nodeid.split("::")[0]


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: WORKERS for a directory or the whole suite, one worker per file for a few files, none (the tests
    in pytest's own process) for one file or chosen tests."""
    if not config.args or any(Path(a.split("::")[0]).is_dir() for a in config.args):
        return WORKERS
    files = {a.split("::")[0] for a in config.args}
    return 0 if len(files) == 1 else min(WORKERS, len(files))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = {g: i for i, g in enumerate(LONGEST)}
    items.sort(key=lambda item: order.get(_group(item), len(order)))
    if hasattr(config, "workerinput"):  # an xdist worker: its controller started it
        path = _groups_file(os.getppid())
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({item.nodeid: _group(item) for item in items}), encoding="utf-8")
        tmp.replace(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # first asked once every worker has collected (and written the file)
                path = _groups_file(os.getpid())
                self.groups = json.loads(path.read_text(encoding="utf-8"))
                path.unlink()
            return self.groups[nodeid]

    return ByGroup(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """A worker's reports (tests.helpers.report), handed to the controller that prints them."""
    node.config.__dict__.setdefault("tuneline_reports", []).extend(
        getattr(node, "workeroutput", {}).get("tuneline_reports", [])
    )


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    for title, lines in config.__dict__.get("tuneline_reports", []):
        terminalreporter.write_sep("-", title)
        for line in lines:
            terminalreporter.write_line(line)
