"""What the run cost, printed after pytest's slowest durations so it is among the last lines of a CI log (a plugin
of tests/conftest.py).

The suite's budget is CI's wall time, and on 2 busy cores that is the CPU-seconds of every process it starts over
2: the figure to compare between runs, as a slower or busier machine moves wall and CPU alike. Each pytest-xdist
worker reports the CPU it and its waited-for children (`tuneline` commands, torchrun and its workers, Prefect
servers) spent from its session's start; the total is pytest's whole process with everything it waited for, the
workers' start-up included. A process killed with its parent (the kill walk's) is reaped by init and not counted.

Above the totals, the tests that cost the most CPU-seconds, where a saving shows (pytest's durations are wall
time, which on shared cores also counts the other workers' load): the worker's own CPU while the test ran, and the
children it waited for between the test's set-up and its tear-down. A child counts when it is waited for:
- a fixture's run that ends during its set-up (the quick start's run, the kill walk) in the first test asking for it;
- a server a fixture stops, with its whole life, in the test whose tear-down stops it: a module's server in the
  module's last test, the worker's session server in its last test (listed "with the session's tear-down");
- a process nobody waits for, when subprocess reaps it, during some later test.
"""

from __future__ import annotations

import os
import time

import pytest

_START = "tuneline_usage_start"
_ROWS = "tuneline_usage"
_TOTAL = "tuneline_usage_total"
_HEAVIEST = "tuneline_heaviest"
HEAVIEST = 25  # tests listed by their CPU-seconds


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.__dict__[_START] = (time.monotonic(), os.times())


def _cpu(t: os.times_result) -> tuple[float, float]:
    return t.user + t.system, t.children_user + t.children_system


def _heaviest(config: pytest.Config) -> list[tuple[float, float, str]]:
    return sorted(config.__dict__.get(_HEAVIEST, []), reverse=True)[:HEAVIEST]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    own, children = _cpu(os.times())
    yield
    now_own, now_children = _cpu(os.times())
    name = item.nodeid if nextitem is not None else f"{item.nodeid}, with the session's tear-down"
    cost = (now_own - own + now_children - children, now_own - own, name)
    rows = item.config.__dict__.setdefault(_HEAVIEST, [])
    rows.append(cost)
    if len(rows) > 4 * HEAVIEST:  # keep the list short over thousands of tests
        rows[:] = _heaviest(item.config)


@pytest.hookimpl(trylast=True)  # after xdist's controller has waited for its workers
def pytest_sessionfinish(session: pytest.Session) -> None:
    started, before = session.config.__dict__[_START]
    (own, children), (own_before, children_before) = _cpu(os.times()), _cpu(before)
    usage = {
        "name": os.environ.get("PYTEST_XDIST_WORKER", "pytest"),
        "wall": time.monotonic() - started,
        "cpu": own - own_before,
        "children": children - children_before,
    }
    if hasattr(session.config, "workeroutput"):  # an xdist worker: the controller prints it
        session.config.workeroutput[_ROWS] = usage
        session.config.workeroutput[_HEAVIEST] = _heaviest(session.config)
        return
    session.config.__dict__.setdefault(_ROWS, []).append(usage)
    session.config.__dict__[_TOTAL] = own + children


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    output = getattr(node, "workeroutput", {})
    if usage := output.get(_ROWS):
        node.config.__dict__.setdefault(_ROWS, []).append(usage)
    # pop: xdist reports a node down twice after a Ctrl-C
    node.config.__dict__.setdefault(_HEAVIEST, []).extend(tuple(row) for row in output.pop(_HEAVIEST, []))


@pytest.hookimpl(trylast=True)  # after pytest's slowest durations
def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    rows = sorted(config.__dict__.get(_ROWS, []), key=lambda u: u["name"])
    workers = len(rows) > 1  # the controller's children are then the workers above
    if heaviest := _heaviest(config):
        terminalreporter.write_sep(
            "-", f"{len(heaviest)} heaviest tests (CPU-s: with the processes waited for, the own process alone)"
        )
        for total, own, nodeid in heaviest:
            terminalreporter.write_line(f"{total:7.1f} {own:7.1f}  {nodeid}")
    terminalreporter.write_sep("-", "suite time")
    for u in rows:
        children = "the workers above" if workers and u["name"] == "pytest" else f"{u['children']:.0f}"
        terminalreporter.write_line(f"{u['name']}: {u['wall']:.0f} s; CPU-s: {u['cpu']:.0f} own, children {children}")
    cores = len(os.sched_getaffinity(0))  # the cores this run may use (a container's cpuset, not the host's count)
    terminalreporter.write_line(f"total: {config.__dict__.get(_TOTAL, 0):.0f} CPU-s on {cores} cores")
