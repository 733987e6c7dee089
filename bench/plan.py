"""Benchmark: `tuneline plan --model-config NAME --gpu-memory 24` for every shipped config, as a new user runs it (a
fresh process each, an empty user cache: the model facts come from the shipped plan_facts.json), against the same
plan with every fact computed afresh (TUNELINE_PLAN_CACHE=off: the denoiser built on the meta device from its
config, one traced forward per resolution the fix search tries: what every plan cost before the facts were kept).
Both must print the same plan, word for word.

Prints, per config, the wall and CPU seconds of both and the plan's first line; then the ratio of the totals and
the load average (these machines are shared: a wall time far above the CPU time is waiting for a core). The RESULT
is the slowest wall time of the plan as users run it, in seconds (goal <= 5).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GOAL = 5.0


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed_plan(name: str, env: dict) -> tuple[float, float, str]:
    started, cpu0 = time.perf_counter(), _cpu()
    out = subprocess.run(
        [sys.executable, "-m", "tuneline.flows.cli", "plan", "--model-config", name, "--gpu-memory", "24"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    wall, cpu = time.perf_counter() - started, _cpu() - cpu0
    if out.returncode not in (0, 2) or not out.stdout.startswith("planned: "):
        sys.exit(f"`tuneline plan --model-config {name}` failed (rc {out.returncode}):\n{out.stderr[-2000:]}")
    return wall, cpu, out.stdout


def main() -> None:
    from tuneline.schemas.model import SHIPPED_CONFIGS

    walls, totals = [], [0.0, 0.0]
    with tempfile.TemporaryDirectory() as cache:
        for name in sorted(SHIPPED_CONFIGS):
            fresh = timed_plan(name, {"TUNELINE_PLAN_CACHE": "off", "TUNELINE_CACHE_DIR": cache})
            kept = timed_plan(name, {"TUNELINE_CACHE_DIR": cache})
            if kept[2] != fresh[2]:
                sys.exit(
                    f"{name}: the plan from kept facts differs from the one computed afresh:\n{kept[2]}\n{fresh[2]}"
                )
            walls.append(kept[0])
            totals[0], totals[1] = totals[0] + fresh[0], totals[1] + kept[0]
            print(
                f"{name:12s} afresh {fresh[0]:6.2f} s wall {fresh[1]:6.2f} s CPU; kept facts {kept[0]:6.2f} s wall "
                f"{kept[1]:6.2f} s CPU; same plan  {kept[2].splitlines()[0]}",
                flush=True,
            )
    print(
        f"all configs: {totals[1]:.1f} s with the kept facts vs {totals[0]:.1f} s afresh ({totals[1] / totals[0]:.2f})"
    )
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    slowest = max(walls)
    print(f"RESULT plan_seconds {slowest:.2f} goal <= {GOAL:g} {'PASS' if slowest <= GOAL else 'FAIL'}")


if __name__ == "__main__":
    main()
