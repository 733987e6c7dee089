"""Benchmark: `tuneline plan --model-config NAME --gpu-memory 24` for every shipped config, as users run it (a fresh
process each: the config read, the denoiser built on the meta device from its config with no weights, one traced
forward per resolution the fix search tries, the plan printed).

Prints, per config, the wall and CPU seconds and the plan's first line; then the load average (these machines are
shared: a wall time far above the CPU time is waiting for a core). The RESULT is the slowest wall time in seconds
(goal <= 5).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GOAL = 5.0


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed_plan(name: str) -> tuple[float, float, str]:
    started, cpu0 = time.perf_counter(), _cpu()
    out = subprocess.run(
        [sys.executable, "-m", "tuneline.flows.cli", "plan", "--model-config", name, "--gpu-memory", "24"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    wall, cpu = time.perf_counter() - started, _cpu() - cpu0
    if out.returncode not in (0, 2) or not out.stdout.startswith("planned: "):
        sys.exit(f"`tuneline plan --model-config {name}` failed (rc {out.returncode}):\n{out.stderr[-2000:]}")
    return wall, cpu, out.stdout.splitlines()[0]


def main() -> None:
    from tuneline.schemas.model import SHIPPED_CONFIGS

    walls = []
    for name in sorted(SHIPPED_CONFIGS):
        wall, cpu, first = timed_plan(name)
        walls.append(wall)
        print(f"{name:12s} {wall:6.2f} s wall {cpu:6.2f} s CPU  {first}", flush=True)
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    slowest = max(walls)
    print(f"RESULT plan_seconds {slowest:.2f} goal <= {GOAL:g} {'PASS' if slowest <= GOAL else 'FAIL'}")


if __name__ == "__main__":
    main()
