"""What the run cost, printed after pytest's slowest durations so it is among the last lines of a CI log (a plugin
of tests/conftest.py).

The suite's budget is CI's wall time, and on 2 busy cores that is the CPU-seconds of every process it starts over
2: the figure to compare between runs, as a slower or busier machine moves wall and CPU alike. Each pytest process
(the controller, or every pytest-xdist worker) reports its own CPU and its waited-for children's: `tuneline`
commands, torchrun and its workers, Prefect servers. A process killed with its parent (the kill walk's) is reaped
by init and not counted.
"""

from __future__ import annotations

import os
import time

import pytest

_START = "tuneline_usage_start"
_ROWS = "tuneline_usage"


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.__dict__[_START] = (time.monotonic(), os.times())


def pytest_sessionfinish(session: pytest.Session) -> None:
    started, before = session.config.__dict__[_START]
    now = os.times()
    usage = {
        "name": os.environ.get("PYTEST_XDIST_WORKER", "pytest"),
        "wall": time.monotonic() - started,
        "cpu": now.user + now.system - before.user - before.system,
        "children": now.children_user + now.children_system - before.children_user - before.children_system,
    }
    if hasattr(session.config, "workeroutput"):  # an xdist worker: the controller prints it
        session.config.workeroutput[_ROWS] = usage
    else:
        session.config.__dict__.setdefault(_ROWS, []).append(usage)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    if usage := getattr(node, "workeroutput", {}).get(_ROWS):
        node.config.__dict__.setdefault(_ROWS, []).append(usage)


@pytest.hookimpl(trylast=True)  # after pytest's slowest durations
def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    rows = sorted(config.__dict__.get(_ROWS, []), key=lambda u: u["name"])
    workers = len(rows) > 1  # the controller's children are then the workers, whose own rows count them
    terminalreporter.write_sep("-", "suite time")
    for u in rows:
        children = "its workers" if workers and u["name"] == "pytest" else f"{u['children']:.0f} in its children"
        terminalreporter.write_line(f"{u['name']}: {u['wall']:.0f} s, {u['cpu']:.0f} CPU-s in the process, {children}")
    total = sum(u["cpu"] + (0 if workers and u["name"] == "pytest" else u["children"]) for u in rows)
    terminalreporter.write_line(f"total: {total:.0f} CPU-s on {os.cpu_count()} cores")
