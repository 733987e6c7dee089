"""The artifact-store lock: a second process waits or refuses naming the holder; the lock dies with its holder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tuneline.stages.common.lock import StoreLocked, holder, store_lock

ROOT = Path(__file__).resolve().parents[2]


def _holder(workdir: Path, seconds: float) -> subprocess.Popen:
    """A separate process that takes the lock, says so on stdout, and keeps it for `seconds`."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from tuneline.stages.common.lock import store_lock
        with store_lock({str(workdir)!r}, timeout=0, purpose="holder under test"):
            print("locked", flush=True)
            time.sleep({seconds})
            open({str(workdir / "holder-finished")!r}, "w").close()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_process_is_refused_with_the_holders_pid(tmp_path):
    proc = _holder(tmp_path, 30)
    try:
        with pytest.raises(StoreLocked) as err:
            with store_lock(tmp_path, timeout=0.5, purpose="second run"):
                pass
        assert f"pid {proc.pid}" in str(err.value) and "holder under test" in str(err.value)
        assert "ops.lock_timeout" in str(err.value)
    finally:
        proc.kill()
        proc.wait()


def test_waiter_gets_the_lock_when_the_holder_finishes(tmp_path):
    proc = _holder(tmp_path, 1.0)
    with store_lock(tmp_path, timeout=30, purpose="waiter"):
        assert (tmp_path / "holder-finished").is_file(), "the waiter got the lock while the holder still worked"
        assert holder(tmp_path)["pid"] == os.getpid()
    assert proc.wait(timeout=10) == 0


def test_lock_dies_with_a_killed_holder(tmp_path):
    proc = _holder(tmp_path, 60)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with store_lock(tmp_path, timeout=0, purpose="after the crash"):  # no stale lock to clean up
        assert holder(tmp_path)["purpose"] == "after the crash"


def test_reentrant_in_one_thread_exclusive_between_threads(tmp_path):
    got: list[str] = []

    def other() -> None:
        try:
            with store_lock(tmp_path, timeout=0.3, purpose="other thread"):
                got.append("acquired")
        except StoreLocked:
            got.append("refused")

    with store_lock(tmp_path, timeout=0, purpose="outer"):
        with store_lock(tmp_path, timeout=0, purpose="inner"):  # a pipeline running a stage flow in-process
            t = threading.Thread(target=other)
            t.start()
            t.join()
    assert got == ["refused"]
    with store_lock(tmp_path, timeout=0, purpose="after"):  # fully released after the outer block
        pass


def test_torchrun_style_children_do_not_inherit_the_lock(tmp_path):
    """A child started while the lock is held (like torchrun) must not keep it after its parent lets go."""
    with store_lock(tmp_path, timeout=0, purpose="parent"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with store_lock(tmp_path, timeout=0, purpose="next run"):
            pass
    finally:
        child.kill()
        child.wait()
