"""Helpers shared by tests: run the CLI as users do."""
from __future__ import annotations

import os
import subprocess
import sys

STAGES = ["scan", "latents", "text", "train", "validate"]


def tuneline(*args: str, timeout: int = 1200, env: dict | None = None) -> subprocess.CompletedProcess:
    """`tuneline ARGS` in a subprocess (same interpreter), capturing stdout and stderr separately."""
    full_env = dict(os.environ) | (env or {})
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)
