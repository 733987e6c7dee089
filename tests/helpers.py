"""Helpers shared by tests: run the CLI as users do."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO

STAGES = ["scan", "latents", "text", "train", "validate"]


ROOT = Path(__file__).resolve().parents[1]


def tuneline(
    *args: str, timeout: int = 1200, env: dict | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`tuneline ARGS` in a subprocess (same interpreter), capturing stdout and stderr separately; from `cwd`
    (default: the repository root) with this checkout importable, as an installed tuneline would be."""
    full_env = dict(os.environ) | (env or {})
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "tuneline.flows.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd or ROOT,
    )


@contextlib.contextmanager
def prefect_api(server: dict | None = None):
    """Prefect called in this process (a flow called directly, artifacts read back) against `server` (the worker's
    `prefect_server`), or without it against the temporary server a client with no PREFECT_API_URL starts: that
    one is stopped on the way out, or it would spend CPU idle until the pytest worker exits (~20 CPU-s)."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if server is not None:
        with temporary_settings({PREFECT_API_URL: server["PREFECT_API_URL"]}):
            yield
        return
    try:
        yield
    finally:
        SubprocessASGIServer().stop()


def spawn(args: list[str], log: IO, env: dict, group: bool = True) -> subprocess.Popen:
    """`args` started from the repository root, stdout and stderr into `log`; `group`: in a process group of its
    own, so a signal to the group (os.killpg) reaches the children too (torchrun and its workers)."""
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=group)


def prefect_cli(*args: str, env: dict, timeout: int = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Prefect's own CLI, as users run it against the same server."""
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ) | env | {"COLUMNS": "250"},
        cwd=cwd or ROOT,
    )


def readme_commands() -> tuple[str, str]:
    """The README quick start's two set-up commands (demo, tests), exactly as written."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = text[text.index("## Quick start") :]
    quick = quick[: quick.index("\n## ", 3)]
    blocks = [b.split("\n", 1)[1].strip() for b in quick.split("```")[1::2]]
    assert len(blocks) == 2, f"the quick start should hold exactly two commands, found {blocks}"
    return blocks[0], blocks[1]


def fresh_clone(dest: Path) -> Path:
    """What `git clone` of this checkout gives (every tracked file, plus untracked ones git does not ignore, as
    they are now), without the build outputs and caches a working checkout accumulates."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


# Set-up steps the tests replace by the interpreter they already run in: installing the same requirements again
# would only measure the machine's network and pip configuration.
INSTALL_STEPS = ("python3 -m venv .venv", "pip install ")


def run_readme_command(command: str, clone: Path, timeout: int = 1800) -> subprocess.CompletedProcess:
    """Run a README command verbatim in `clone` with bash, except that `.venv` is this test run's environment
    (a link to it) and the steps creating or filling it are skipped. `tuneline` is then the installed console
    script; PYTHONPATH makes it run the clone's code."""
    steps = [s.strip() for s in command.split("&&")]
    kept = [s for s in steps if not s.startswith(INSTALL_STEPS)]
    assert kept[0] == ". .venv/bin/activate", f"the command no longer activates .venv first: {command}"
    venv = clone / ".venv"
    if not venv.exists():
        venv.symlink_to(Path(sys.prefix), target_is_directory=True)
    env = dict(os.environ) | {"PYTHONPATH": str(clone)}
    return subprocess.run(
        ["bash", "-c", " && ".join(kept)], cwd=clone, capture_output=True, text=True, timeout=timeout, env=env
    )


class PrefectServer:
    """One Prefect server for a batch of CLI runs, as a user with a server configures it (`PREFECT_API_URL`): each
    run then skips starting its own temporary server (~10 s of CPU on 2 cores). The test session's is the
    `prefect_server` fixture (tests/conftest.py); bench/faults.py starts one per walk. `server_settings` go to
    the server alone (e.g. PREFECT_SERVER_API_AUTH_STRING)."""

    def __init__(self, **server_settings: str) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="tuneline-prefect-server-"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = os.environ | {
            "PREFECT_HOME": str(self.home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(self.home / "results"),
            "PREFECT_API_URL": f"{self.url}/api",
        }
        self.server_settings = server_settings
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> PrefectServer:
        env = {k: v for k, v in self.env.items() if k != "PREFECT_API_URL"} | self.server_settings
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/api/health", timeout=2):
                    return self
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        raise RuntimeError("prefect server did not become healthy in 300 s")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.home, ignore_errors=True)


def report(config, title: str, lines: list[str]) -> None:
    """Lines for the end of the run's output (the kill walk's summary), from pytest's process or an xdist worker."""
    sink = config.workeroutput if hasattr(config, "workeroutput") else config.__dict__
    sink.setdefault("tuneline_reports", []).append((title, lines))
