"""`tuneline worker`: a Prefect process worker for the pool, restarted when it crashes.

Prefect 3.8's worker exits when a flow run is retried while the process of its previous attempt is still
shutting down (`RuntimeError: this borrower is already holding one of this CapacityLimiter's tokens`,
PrefectHQ/prefect#16806): exactly what Retry pressed right after a failure does. The retried run stays
Scheduled, so a restarted worker picks it up. A worker that keeps dying at once (wrong API URL, bad auth) is
not restarted forever.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

RESTART_DELAY_S = 2.0
QUICK_EXIT_S = 30.0  # a worker that dies sooner than this counts as failing to start
MAX_QUICK_EXITS = 5

log = logging.getLogger("tuneline")


def worker_command(pool: str, limit: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"]
    return cmd + (["--limit", str(limit)] if limit else [])


def serve(pool: str, limit: int | None) -> int:
    """Run the worker until it stops cleanly or is signalled; returns its exit code."""
    state: dict = {"stopping": False, "child": None}

    def forward(signum: int, _frame) -> None:
        state["stopping"] = True
        child = state["child"]
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    quick_exits = 0
    while True:
        started = time.monotonic()
        state["child"] = subprocess.Popen(worker_command(pool, limit))
        rc = state["child"].wait()
        if state["stopping"] or rc == 0:
            return rc
        quick_exits = quick_exits + 1 if time.monotonic() - started < QUICK_EXIT_S else 0
        if quick_exits >= MAX_QUICK_EXITS:
            log.error(
                "the Prefect worker exited %d times in a row right after starting (code %d); giving up", quick_exits, rc
            )
            return rc
        log.warning("the Prefect worker exited with code %d; restarting it in %.0f s", rc, RESTART_DELAY_S)
        time.sleep(RESTART_DELAY_S)
