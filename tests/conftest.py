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
    # The workers outnumber CI's cores: one torch thread each, as training processes have (train.threads_per_process),
    # or each op of a tiny model in the worker's own process waits for its second thread to get a core.
    os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", os.path.join(_home, "results"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("OMP_NUM_THREADS", "2")


import pytest  # noqa: E402

# tests.workers: how the suite spreads over pytest-xdist workers; tests.suitetime: what the run cost, printed after
# the slowest durations
pytest_plugins = ["tests.workers", "tests.suitetime"]


@pytest.fixture(scope="session")
def prefect_server():
    """Each worker's one Prefect server: the environment (`PREFECT_API_URL` ...) for `tuneline` subprocesses whose
    test is not about the temporary server a command starts without one (the quick start and the tests of
    tests/reliability/test_cli_server.py walk that path)."""
    from tests.helpers import PrefectServer

    with PrefectServer(**_SESSION_SERVER) as server:
        yield server.env


_OFF = "false"
# The session server runs what its tests use and nothing else: one runs per pytest-xdist worker (3 on CI's 2 cores)
# for the whole session, and every loop of a background service takes CPU-seconds from the tests. Measured on 2
# cores: the services turned off below cost ~0.5 CPU-s a minute idle (~70 CPU-s over a 34-minute suite, 4 servers)
# and registering block types ~1.4 CPU-s at start; the server's CPU per `tuneline run` stayed the same.
_SESSION_SERVER = {
    # No UI: nothing here opens it, and the server starts faster without building its static files.
    "PREFECT_SERVER_UI_ENABLED": _OFF,
    # No block types: neither tuneline nor these tests save or load a Prefect block.
    "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": _OFF,
    # No deployment here has a schedule, and a run started on a pool is picked up whether or not it is marked Late.
    "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": _OFF,
    "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED": _OFF,
    # Worker, pool and deployment health (what the UI shows): no test reads it; the workers poll either way.
    "PREFECT_SERVER_SERVICES_FOREMAN_ENABLED": _OFF,
    # Nothing pauses a run here, and a cancelled one (a stopped training) has no child runs to clean up (the kill
    # walk SIGKILLs its runs).
    "PREFECT_SERVER_SERVICES_CANCELLATION_CLEANUP_ENABLED": _OFF,
    "PREFECT_SERVER_SERVICES_CLEANUP_RECONCILER_ENABLED": _OFF,
    "PREFECT_SERVER_SERVICES_PAUSE_EXPIRATIONS_ENABLED": _OFF,
    # Events are not stored or acted on: no automations, no test reads events, and tuneline has no tasks (a
    # subflow's task run is created by its parent directly, not from events) whose runs the recorder would write.
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": _OFF,
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": _OFF,
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED": _OFF,
    # Kept: the repossessor frees the training slot of a killed run when its lease expires (test_faults.py checks
    # it), and the events stream costs nothing while no one subscribes.
}


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


@pytest.fixture(scope="session")
def upstream_store(tmp_path_factory):
    """The run's store of built upstream caches (tests/upstream_store.py): one for all of pytest-xdist's workers
    (in the folder above theirs), so a set of caches is built once per run."""
    from tests.upstream_store import UpstreamStore

    if os.environ.get("PYTEST_XDIST_WORKER"):
        return UpstreamStore(tmp_path_factory.getbasetemp().parent / "upstream-store")
    return UpstreamStore(tmp_path_factory.mktemp("upstream-store"))


@pytest.fixture(scope="session")
def demo_data(upstream_store) -> Path:
    """The demo dataset, written once per run: configs on it share their upstream caches through the store."""
    from tuneline.stages.scan.demo import write_demo_dataset

    return upstream_store.dataset("demo", write_demo_dataset)
