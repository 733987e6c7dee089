"""The temporary Prefect API server a `tuneline run` / `tuneline stage` starts when no server is configured.

Prefect would start one itself on first use, but its start gives up after 20 s
(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS), while a fresh PREFECT_HOME's migrations alone take ~14 s on an
idle 2-core machine: a busy machine crashed every command with a traceback. Started here instead, it
- waits longer by default (STARTUP_S, sized for 6 busy processes on 2 cores) and retries once, then says in one
  line what to set or start;
- runs in its own session, so a Ctrl-C to the terminal's process group does not kill it under the flow runs
  still reporting their end (Prefect then retried a dead API for minutes and left the runs `Running`);
- dies with this process even when it is SIGKILLed (PR_SET_PDEATHSIG set before exec), so a killed `tuneline`
  orphans no server.
The server is the one Prefect runs for its own temporary server (its API app, migrations, no UI, no services).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
# Prefect's default is 20 s. A fresh PREFECT_HOME needs ~14 s of migrations on an idle 2-core machine and about
# 4x that with 6 busy processes on those 2 cores (plus Python start-up): 180 s leaves room, and one retry follows.
STARTUP_S = 180.0
PORT_IN_USE_EXIT = 3  # uvicorn's exit code when its port was taken between our check and its bind

# Runs in the server's process before exec: the kernel sends SIGKILL to it when its parent (this process) dies,
# whatever killed the parent. Checked again after prctl: the parent may have died before the request took effect.
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG\n"
    "os.getppid() == int(sys.argv[1]) or sys.exit(1)\n"
    "os.execv(sys.executable, [sys.executable] + sys.argv[2:])\n"
)


class ServerUnavailable(RuntimeError):
    """The temporary server did not start; the message is one line saying what to set or start."""


def startup_timeout() -> float:
    """The user's PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS when set, else ours (not Prefect's 20 s)."""
    try:
        return float(os.environ[TIMEOUT_ENV])
    except (KeyError, ValueError):
        return STARTUP_S


class TemporaryServer:
    """One server for this process; `start()` returns its API URL."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        # The server's output, read back only to explain a failed start. A file without a name: nothing is left in
        # the temporary folder, even when this process is SIGKILLed.
        self.log = tempfile.TemporaryFile(prefix="tuneline-prefect-server-")

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self) -> str:
        timeout = startup_timeout()
        atexit.register(self.stop)
        for _attempt in (1, 2):
            if self._start_once(timeout):
                return self.api_url
            self.stop()
        why = self._why()
        raise ServerUnavailable(
            f"the temporary Prefect server did not start within {timeout:.0f} s, twice{why} (a busy machine is "
            f"the usual cause): set {TIMEOUT_ENV} higher, or start a server (`prefect server start`) and point "
            f"tuneline at it with PREFECT_API_URL=http://127.0.0.1:4200/api"
        )

    def _start_once(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        self._spawn()
        while time.monotonic() < deadline:
            assert self.proc is not None
            rc = self.proc.poll()
            if rc == PORT_IN_USE_EXIT:
                self._spawn()
                continue
            if rc is not None:
                return False
            if _healthy(self.api_url):
                return True
            time.sleep(0.2)
        return False

    def _spawn(self) -> None:
        from prefect.settings import get_current_settings

        self.port = _free_port()
        env = {
            **os.environ,
            **get_current_settings().to_environment_variables(exclude_unset=True),
            # what Prefect sets for its own temporary server: no UI, no background services
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
        }
        env.pop("PREFECT_API_URL", None)
        server = [
            "-m",
            "uvicorn",
            "--factory",
            "prefect.server.api.server:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "error",
            "--lifespan",
            "on",
        ]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid()), *server],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            start_new_session=True,
        )

    def _why(self) -> str:
        self.log.seek(0)
        lines = [ln for ln in self.log.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        return f" (last server output: {lines[-1].strip()[:200]})" if lines else ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                pass


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_server: TemporaryServer | None = None


def ephemeral_api_url() -> str | None:
    """The URL of the temporary server this process started, or None (a configured server, or none yet)."""
    return _server.api_url if _server is not None and _server.proc is not None else None


# Files in the directory a command runs in that Prefect 3 also reads settings from.
LOCAL_SETTINGS_FILES = (".env", "prefect.toml", "pyproject.toml")


def server_configured() -> bool:
    """Whether Prefect would talk to a server (PREFECT_API_URL), decided without importing Prefect where no setting
    can say so: its settings import is most of a no-op `tuneline run`'s second. Wherever one might (the
    environment, a settings file in this directory, the active profile in Prefect's profile files), Prefect's own
    settings decide."""
    if os.environ.get("PREFECT_API_URL"):
        return True
    if any(Path(name).is_file() for name in LOCAL_SETTINGS_FILES) or _profile_may_name_a_server():
        from prefect.settings import get_current_settings

        return bool(get_current_settings().api.url)
    return False


def _profile_may_name_a_server() -> bool:
    """Whether the active profile sets PREFECT_API_URL in Prefect's own profiles file (its `local` profile does)
    or the user's (True too when a file cannot be read: Prefect then decides)."""
    import importlib.util
    import tomllib

    spec = importlib.util.find_spec("prefect")  # finds the package without importing it
    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    files = [
        Path(spec.origin).parent / "settings" / "profiles.toml" if spec and spec.origin else None,
        Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser(),
    ]
    loaded = []
    for path in filter(None, files):
        try:
            loaded.append(tomllib.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            return True
    active = os.environ.get("PREFECT_PROFILE") or next(
        (d["active"] for d in reversed(loaded) if "active" in d), "ephemeral"
    )
    return any("PREFECT_API_URL" in d.get("profiles", {}).get(active, {}) for d in loaded)


def api_for_flows() -> str | None:
    """Make sure flow runs have an API: the configured server (PREFECT_API_URL, env or profile) is used as is;
    else a temporary one is started (once per process). Returns the temporary server's URL, or None."""
    global _server
    from prefect.settings import get_current_settings

    if get_current_settings().api.url:
        return None
    if _server is None or _server.proc is None:
        # The wait is silent otherwise (20 s and more): say what it is and how to skip it.
        print(
            "starting a temporary Prefect server (~20 s); set PREFECT_API_URL to use yours", file=sys.stderr, flush=True
        )
        started = time.monotonic()
        _server = TemporaryServer()
        _server.start()
        print(f"temporary Prefect server ready ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    return _server.api_url
