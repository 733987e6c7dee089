"""Training processes die with their parent (docs/design.md "Processes and locks").

torchrun starts workers in their own sessions, so a SIGKILL to the `tuneline` process group does not reach
them. Each process we start under torchrun watches the pid that started it and exits once it is gone:
the agent sends itself SIGTERM (torchrun then stops its workers), a worker exits at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

PARENT_ENV = "TUNELINE_PARENT_PID"


def _set_pdeathsig() -> None:
    """Linux: also ask the kernel to SIGKILL us when our parent dies (covers the window before the thread runs)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def watch_parent(parent_pid: int, on_orphan: str = "kill", interval: float = 0.2) -> None:
    """Start a daemon thread that ends this process when `parent_pid` is no longer our parent."""

    def loop() -> None:
        while True:
            if os.getppid() != parent_pid:
                if on_orphan == "term":
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)  # give torchrun's handler time to stop its workers, then make sure
                os._exit(137)
            time.sleep(interval)

    if os.getppid() != parent_pid:
        os._exit(137)
    threading.Thread(target=loop, name="tuneline-parent-watch", daemon=True).start()


def agent_main() -> None:
    """Entry point for the torchrun agent: watch our launcher, then run torchrun as usual."""
    parent = int(os.environ.get(PARENT_ENV, os.getppid()))
    _set_pdeathsig()
    watch_parent(parent, on_orphan="term")
    os.environ[PARENT_ENV] = str(os.getpid())  # workers watch the agent
    from torch.distributed.run import get_args_parser, main

    sys.argv = grace_compat(sys.argv, "--shutdown-timeout" in get_args_parser()._option_string_actions)
    main()


def grace_compat(argv: list[str], supported: bool) -> list[str]:
    """torchrun before torch 2.12 has no --shutdown-timeout and waits a fixed 30 s for its workers after a stop.
    There the flag is taken off the command line and the same wait is given to torchrun's process context, whose
    `close` takes it as an argument (a stop checkpoint of a large model takes longer than 30 s to write)."""
    flag = [a for a in argv if a.startswith("--shutdown-timeout=")]
    if supported or not flag:
        return argv
    grace = int(flag[0].split("=", 1)[1])
    from torch.distributed.elastic.multiprocessing import api

    close = api.PContext.close
    api.PContext.close = lambda self, death_sig=None, timeout=grace: close(self, death_sig, timeout)
    return [a for a in argv if a not in flag]


def worker_guard() -> None:
    """Called first thing in every training worker."""
    parent = os.environ.get(PARENT_ENV)
    if parent:
        watch_parent(int(parent), on_orphan="kill")


if __name__ == "__main__":
    agent_main()
