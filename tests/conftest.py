"""Shared test setup: Prefect state in temp dirs, repo root importable."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Prefect keeps its database and cached results under PREFECT_HOME: isolate them per test session so
# nothing leaks between runs (PLATFORM.md).
_home = tempfile.mkdtemp(prefix="tuneline-prefect-")
os.environ.setdefault("PREFECT_HOME", _home)
os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", os.path.join(_home, "results"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("OMP_NUM_THREADS", "2")
