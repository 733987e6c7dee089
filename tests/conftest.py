"""Shared test setup: Prefect state in temp dirs, repo root importable."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Prefect keeps its database and cached results under PREFECT_HOME: isolate them per test session so
# nothing leaks between runs (docs/platform.md). pytest-xdist's workers inherit the controller's environment: each
# worker takes its own folder under it, as two Prefect processes writing one SQLite database lock each other out.
_home = os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="tuneline-prefect-"))
if os.environ.get("PYTEST_XDIST_WORKER"):
    _home = os.environ["PREFECT_HOME"] = os.path.join(_home, os.environ["PYTEST_XDIST_WORKER"])
    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = os.path.join(_home, "results")
os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", os.path.join(_home, "results"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("OMP_NUM_THREADS", "2")


import pytest  # noqa: E402

# Most of the suite waits (a Prefect server starting, torchrun's interpreters importing torch, a stop's grace
# period) rather than computes, so more pytest-xdist workers than CI's 2 cores pay (tests/README.md).
WORKERS = 4
# Session fixtures that several modules read: every test using one runs on one worker, so each is built once.
SHARED = {"demo_run": "demo", "kill_walk": "prepared", "prepared": "prepared"}
# The groups of several minutes (the slowest list), started first so none starts last and runs on alone.
LONGEST = (
    "prepared",
    "demo",
    "tests/integration/test_run_column.py",
    "tests/integration/test_training_matrix.py",
    "tests/integration/test_ddp_train.py",
    "tests/integration/test_multinode.py",
    "tests/reliability/test_cli_server.py",
)


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject.toml): WORKERS for a directory or the whole suite, one worker per file for a few files,
    none (the tests in pytest's own process) for one file or chosen tests."""
    if not config.args or any(Path(a.split("::")[0]).is_dir() for a in config.args):
        return WORKERS
    files = {a.split("::")[0] for a in config.args}
    return 0 if len(files) == 1 else min(WORKERS, len(files))


def pytest_collection_modifyitems(config, items):
    """Group each test for `--dist loadgroup`: by the shared session fixture it reads, else by its module, so a
    module's fixtures (upstream caches, a server) are built once on one worker as in a run without workers."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            shared = [SHARED[f] for f in item.fixturenames if f in SHARED]
            item.add_marker(pytest.mark.xdist_group(shared[0] if shared else item.nodeid.split("::")[0]))
    order = {g: i for i, g in enumerate(LONGEST)}
    items.sort(key=lambda item: order.get(item.get_closest_marker("xdist_group").args[0], len(order)))


@pytest.fixture(scope="session")
def prefect_server():
    """The session's one Prefect server: the environment (`PREFECT_API_URL` ...) for `tuneline` subprocesses whose
    test is not about the temporary server a command starts without one (the quick start and the tests of
    tests/reliability/test_cli_server.py walk that path)."""
    from tests.helpers import PrefectServer

    # No UI: nothing here opens it, and the server starts faster without building its static files.
    with PrefectServer(PREFECT_SERVER_UI_ENABLED="false") as server:
        yield server.env


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """The README's quick start as written, in a fresh clone in a temp directory, with no --workdir: the demo
    end to end, on the demo's 2 training processes and its own temporary Prefect server, as a new user runs it.
    Every test that inspects the demo's results reads this run's default workdir."""
    from tests.helpers import fresh_clone, readme_commands, run_readme_command

    clone = fresh_clone(tmp_path_factory.mktemp("clone"))
    demo_command, _ = readme_commands()
    out = run_readme_command(demo_command, clone)
    assert out.returncode == 0, f"the README's quick start failed:\n{out.stdout[-2000:]}\n{out.stderr[-6000:]}"
    return {"workdir": clone / "tuneline-work", "clone": clone, "stdout": out.stdout, "stderr": out.stderr}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """An xdist worker's reports, handed to the controller that prints the summary."""
    node.config.__dict__.setdefault("tuneline_reports", []).extend(node.workeroutput.get("tuneline_reports", []))


def pytest_terminal_summary(terminalreporter, config):
    for title, lines in config.__dict__.get("tuneline_reports", []):
        terminalreporter.write_sep("-", title)
        for line in lines:
            terminalreporter.write_line(line)
