"""The temporary Prefect server a `tuneline` command starts: it comes up on a busy machine with default settings,
says in one line what to do when it cannot, outlives a Ctrl-C long enough for the flow runs to record their end,
and never outlives a killed `tuneline`. These tests use no shared server: they walk the user's path."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _env(home: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **extra,
    )
    return env


def _terminal_signals() -> None:
    """Ctrl-C as a terminal's foreground command takes it: a test run started in the background of a
    non-interactive shell (`pytest ... &`) ignores SIGINT, and its children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tuneline.flows.cli", *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_terminal_signals,
    )


def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p.name))
    return out


def _is_server(pid: int) -> bool:
    try:
        return b"uvicorn" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for_server(proc: subprocess.Popen, limit: float = 300) -> int:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        servers = [c for c in _children(proc.pid) if _is_server(c)]
        if servers:
            return servers[0]
        time.sleep(0.2)
    raise AssertionError(f"no Prefect server process appeared under tuneline (rc {proc.poll()})")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_tuneline_takes_its_temporary_server_along(tmp_path, sig):
    """The OOM killer or `kill PID` hits only the tuneline process: its server must not live on (~200 MB each),
    nor its output file in the temporary folder (one per killed run, never cleaned)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = _start(["run", "--workdir", str(tmp_path / "w")], _env(tmp_path / "home", TMPDIR=str(tmp)))
    server = _wait_for_server(proc)
    os.kill(proc.pid, sig)
    proc.wait(timeout=120)  # not communicate(): an orphaned server would hold its output pipes open
    deadline = time.monotonic() + 30
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = _alive(server)
    if alive:
        os.kill(server, signal.SIGKILL)
    assert not alive, f"the temporary Prefect server (pid {server}) outlived `tuneline` killed by {sig.name}"
    left = [p.name for p in tmp.iterdir() if p.name.startswith("tuneline-")]
    assert not left, f"`tuneline` killed by {sig.name} left {left} in the temporary folder"


def test_a_stage_completes_with_both_cores_saturated(tmp_path):
    """Six busy processes on the machine's cores and a fresh PREFECT_HOME (migrations included), default
    settings: the stage completes."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(6)]
    try:
        proc = _start(["stage", "scan", "--workdir", str(tmp_path / "w")], _env(tmp_path / "fresh-home"))
        out, err = proc.communicate(timeout=1200)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_a_server_that_cannot_start_is_one_line_naming_the_setting(tmp_path):
    proc = _start(
        ["stage", "scan", "--workdir", str(tmp_path / "w")],
        _env(tmp_path / "home", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1"),
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    # The notice that a temporary server is starting, then the refusal in one line.
    notice, *lines = err.strip().splitlines()
    assert notice.startswith("starting a temporary Prefect server"), err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in lines[0] and "PREFECT_API_URL" in lines[0]


def test_ctrl_c_during_training_ends_promptly_and_records_the_runs(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) while the demo trains: tuneline ends within the time the
    workers take to checkpoint, as a stop (exit code 3, its step and checkpoint) with no connection tracebacks,
    and no flow run is left Running."""
    home = tmp_path / "home"
    env = _env(home)
    proc = _start(["run", "--workdir", str(tmp_path / "w")], env)
    err_lines: list[str] = []
    assert proc.stderr is not None
    for line in proc.stderr:
        err_lines.append(line)
        if re.search(r"\bstep \d+/\d+", line):  # a training step's line (not the plan's stop-grace line)
            break
    else:
        raise AssertionError("training never started:\n" + "".join(err_lines[-40:]))
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, rest = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, rest = proc.communicate()
        tail = ("".join(err_lines) + (rest or ""))[-4000:]
        raise AssertionError(f"tuneline was still running 150 s after Ctrl-C; its stderr:\n{tail}") from None
    err = "".join(err_lines) + (rest or "")
    assert proc.returncode == 3, f"tuneline did not end as stopped (exit 3) on Ctrl-C; its stderr:\n{err[-3000:]}"
    assert "ConnectError" not in err and "Traceback" not in err, err[-4000:]
    assert "error: stopped at step" in err and "rerun to continue" in err, err[-2000:]
    states = _flow_run_states(env)
    assert states and "RUNNING" not in states and "PENDING" not in states, states


def _flow_run_states(env: dict, workdir: Path | None = None) -> list[str]:
    """Every flow run's state in the PREFECT_HOME's database, read through Prefect's client; with `workdir`, only
    those of runs on that workdir (a server other tests use too)."""
    # Newest first: the server's default order is by (random) id, which on a server holding other tests' runs
    # could leave this run past the 200 a read returns.
    code = (
        "import asyncio, sys\nfrom prefect import get_client\nfrom prefect.client.schemas.sorting import FlowRunSort\n"
        "def mine(r):\n    return len(sys.argv) < 2 or (r.parameters.get('config') or {}).get('workdir') == sys.argv[1]\n"
        "async def main():\n    async with get_client() as c:\n"
        "        runs = await c.read_flow_runs(sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=200)\n"
        "        print(' '.join(r.state.type.value for r in runs if mine(r)))\n"
        "asyncio.run(main())\n"
    )
    # Without PREFECT_API_URL this read starts its own temporary server, not the one under test: more than the
    # default 20 s to start on a busy machine.
    env = env | {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}
    args = [sys.executable, "-c", code, *([str(workdir)] if workdir else [])]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()
