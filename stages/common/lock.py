"""One writer at a time on a workdir's artifact store: `flock` on `<workdir>/.tuneline.lock`.

A flock belongs to the open file, so the kernel drops it when its holder exits however it dies (SIGKILL
included): the lock never outlives its process and needs no stale-lock cleanup. The file's text names the
holder (pid, host, purpose) only for the refusal message; the flock is the truth. The lock is re-entrant
within one thread (the pipeline runs stage flows inside its own process) and exclusive between threads.
Files opened by Python are not inherited by child processes (PEP 446), so torchrun workers never hold it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

LOCK_NAME = ".tuneline.lock"
IN_USE = ".in-use"
POLL_SECONDS = 0.2

log = logging.getLogger("tuneline")


class StoreLocked(RuntimeError):
    """Another process holds the artifact store's lock past the wait timeout."""


class _Held:
    def __init__(self) -> None:
        self.thread_lock = threading.RLock()
        self.fd: int | None = None
        self.depth = 0


_held: dict[str, _Held] = {}
_registry_guard = threading.Lock()


def lock_path(workdir: Path) -> Path:
    return Path(workdir) / LOCK_NAME


def holder(workdir: Path) -> dict:
    """Who wrote the lock file last: the holder while it is locked (empty dict if unreadable)."""
    try:
        return json.loads(lock_path(workdir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def describe_holder(info: dict) -> str:
    if not info:
        return "another process (its pid was not recorded yet)"
    since = datetime.fromtimestamp(info.get("since", 0), UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"pid {info.get('pid')} on {info.get('host')} ({info.get('purpose')}, since {since})"


@contextmanager
def store_lock(workdir: Path, *, timeout: float, purpose: str) -> Iterator[None]:
    """Hold the store's lock for the block; wait up to `timeout` seconds for another holder, then refuse."""
    path = lock_path(workdir)
    with _registry_guard:
        held = _held.setdefault(str(path.resolve()), _Held())
    deadline = time.monotonic() + timeout
    if not held.thread_lock.acquire(timeout=max(timeout, 0)):
        raise StoreLocked(_refusal(workdir, timeout))
    try:
        if held.depth == 0:
            held.fd = _acquire(path, workdir, deadline, timeout, purpose)
        held.depth += 1
        try:
            yield
        finally:
            held.depth -= 1
            if held.depth == 0 and held.fd is not None:
                os.close(held.fd)  # closing the file releases the flock
                held.fd = None
    finally:
        held.thread_lock.release()


def _acquire(path: Path, workdir: Path, deadline: float, timeout: float, purpose: str) -> int:
    def waiting() -> None:
        log.info(
            "artifact store %s is locked by %s; waiting up to %.0f s",
            workdir,
            describe_holder(holder(workdir)),
            timeout,
        )

    fd = _flock_wait(path, fcntl.LOCK_EX, deadline, waiting)
    if fd is None:
        raise StoreLocked(_refusal(workdir, timeout))
    info = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": purpose, "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    return fd


@contextmanager
def in_use(folder: Path) -> Iterator[None]:
    """Mark a work-in-progress folder as in use for the block (a shared flock: several nodes of one training may
    hold it), so housekeeping that removes interrupted work leaves it alone."""
    fd = os.open(Path(folder) / IN_USE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def is_in_use(folder: Path) -> bool:
    path = Path(folder) / IN_USE
    if not path.is_file():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EACCES):
            return True
        raise
    finally:
        os.close(fd)


def _refusal(workdir: Path, timeout: float) -> str:
    return (
        f"the artifact store in {workdir} is in use by {describe_holder(holder(workdir))}; waited "
        f"{timeout:.0f} s. Let that run finish (or stop it: the lock is released when its process exits), "
        f"or raise ops.lock_timeout to wait longer"
    )


RUNS_NAME = ".tuneline.runs"


class RunInProgress(StoreLocked):
    """A pipeline run holds its lease on the workdir: housekeeping would collect versions it uses."""


def _flock_wait(path: Path, mode: int, deadline: float, waiting: Callable[[], None] = lambda: None) -> int | None:
    """An fd holding `mode` (LOCK_SH/LOCK_EX) on `path`, or None once `deadline` passes; `waiting` is called once,
    when the lock is first found held."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    waited = False
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return fd
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
        if time.monotonic() >= deadline:
            os.close(fd)
            return None
        if not waited:
            waiting()
            waited = True
        time.sleep(POLL_SECONDS)


@contextmanager
def run_lease(workdir: Path, *, timeout: float) -> Iterator[None]:
    """A pipeline run's lease on the workdir for its whole length: a shared flock on `<workdir>/.tuneline.runs`.

    Runs share it (each stage still takes the store lock); `tuneline gc` takes it exclusively, so it never runs
    while a run is between two stages and would collect what that run just published or is about to consume.
    Like the store lock it is a flock: the kernel drops it when the run's process dies, however it dies."""
    fd = _flock_wait(lock_path(workdir).with_name(RUNS_NAME), fcntl.LOCK_SH, time.monotonic() + timeout)
    if fd is None:
        raise StoreLocked(
            f"`tuneline gc` holds the workdir {workdir} and did not finish within {timeout:.0f} s; "
            f"wait for it, or raise ops.lock_timeout"
        )
    key = str(Path(workdir).resolve())
    _active_runs[key] = f"{os.getpid()}-{time.monotonic_ns()}"
    try:
        yield
    finally:
        _active_runs.pop(key, None)
        os.close(fd)


_active_runs: dict[str, str] = {}


def active_run(workdir: Path) -> str | None:
    """A token naming the pipeline run this process has in progress on `workdir` (None outside one): what a
    run decides once, such as the dataset listing its scan used, is kept for the run under it."""
    return _active_runs.get(str(Path(workdir).resolve()))


@contextmanager
def exclusive_runs(workdir: Path, *, timeout: float) -> Iterator[None]:
    """No pipeline run in progress for the block (gc): waits up to `timeout` for running ones, then refuses."""
    fd = _flock_wait(lock_path(workdir).with_name(RUNS_NAME), fcntl.LOCK_EX, time.monotonic() + timeout)
    if fd is None:
        raise RunInProgress(
            f"a `tuneline run` is in progress in {workdir} (waited {timeout:.0f} s): gc never "
            f"collects versions a run in progress published or uses; run `tuneline gc` again "
            f"when it has finished, or raise ops.lock_timeout to wait longer"
        )
    try:
        yield
    finally:
        os.close(fd)
