"""Benchmark: `tuneline status` on the demo's workdir, as users run it (a fresh process each time).

Builds the demo workdir once (`tuneline run --workdir <temp>`, kept for later runs while its status is all fresh),
then times three fresh `tuneline status` processes and, as the floor any CLI pays on this machine, three bare
`python -c pass` starts. Prints both; the RESULT is the median status time in seconds (goal <= 2.5).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKDIR = Path(tempfile.gettempdir()) / "tuneline-bench-status"
GOAL = 2.5


def tuneline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuneline.flows.cli", *args], cwd=ROOT, capture_output=True, text=True)


def timed(cmd: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, capture_output=True, check=True)
    return time.perf_counter() - started


def main() -> None:
    status = tuneline("status", "--workdir", str(WORKDIR), "--json")
    if status.returncode != 0 or any(r["state"] != "fresh" for r in json.loads(status.stdout or "[]")):
        print(f"building the demo workdir {WORKDIR} (a few minutes)", flush=True)
        run = tuneline("run", "--workdir", str(WORKDIR))
        if run.returncode != 0:
            sys.exit(f"demo run failed:\n{run.stderr[-3000:]}")
    cmd = [sys.executable, "-m", "tuneline.flows.cli", "status", "--workdir", str(WORKDIR)]
    times = [timed(cmd) for _ in range(3)]
    floor = [timed([sys.executable, "-c", "pass"]) for _ in range(3)]
    print(
        f"tuneline status: {', '.join(f'{t:.2f}' for t in times)} s; python start alone: "
        f"{statistics.median(floor):.2f} s"
    )
    median = statistics.median(times)
    print(f"RESULT status_seconds {median:.3f} goal <= {GOAL} {'PASS' if median <= GOAL else 'FAIL'}")


if __name__ == "__main__":
    main()
