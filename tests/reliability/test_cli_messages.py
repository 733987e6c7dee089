"""Each message once, the cause named: a user error raised inside a flow, a server that wants credentials, two runs
racing for a fresh demo workdir, and what a non-terminal log of the demo shows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT, PrefectServer, tuneline

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _plain_env(home: Path, **extra: str) -> dict:
    """No shared server: the command walks the user's path (its own temporary server)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return env | {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"} | extra


def test_a_user_error_inside_a_flow_is_printed_once_without_traceback(tmp_path):
    (tmp_path / "empty").mkdir()
    cfg = yaml.safe_load(tuneline("config", "example").stdout)
    cfg["dataset"].update(path=str(tmp_path / "empty"), demo=False)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tuneline.flows.cli",
            "stage",
            "scan",
            str(tmp_path / "c.yaml"),
            "--workdir",
            str(tmp_path / "w"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
        env=_plain_env(tmp_path / "home") | {"PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.count("no image was accepted") == 1, out.stderr[-3000:]
    assert "Starting temporary server" not in out.stderr and "View at" not in out.stderr, out.stderr[-3000:]


class _AuthServer(PrefectServer):
    def status(self, route: str, method: str = "GET") -> int | None:
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + route, method=method), timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as err:
            return err.code
        except OSError:
            return None


@pytest.fixture(scope="module")
def auth_server():
    with _AuthServer(PREFECT_SERVER_API_AUTH_STRING="admin:secret") as server:
        yield server


def test_a_401_is_one_line_naming_the_setting(auth_server, tmp_path):
    out = tuneline(
        "stage",
        "scan",
        "--workdir",
        str(tmp_path / "w"),
        env=_plain_env(tmp_path / "home", PREFECT_API_URL=auth_server.url + "/api"),
    )
    assert out.returncode == 1, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "401" in lines[0] and "PREFECT_API_AUTH_STRING" in lines[0], out.stderr[-3000:]


def test_docs_name_every_api_route_open_without_credentials(auth_server):
    docs = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    section = docs[docs.index("## Prefect authentication") :]
    section = section.split("\n## ", 1)[0]
    candidates = [
        "/api/health",
        "/api/ready",
        "/api/version",
        "/api/csrf-token",
        "/api/admin/settings",
        "/api/admin/version",
        "/api/openapi.json",
        "/api/docs",
        "/api/flows/filter",
        "/api/flow_runs/filter",
        "/api/work_pools/filter",
        "/api/deployments/filter",
        "/api/events/filter",
    ]
    for route in candidates:
        for method in ("GET", "POST"):
            code = auth_server.status(route, method)
            if code not in (401, 404, 405):
                assert f"`{method} {route}`" in section, (
                    f"{method} {route} answers {code} without credentials "
                    f"but the auth section of docs/operations.md does not name it"
                )


def test_two_runs_on_a_fresh_demo_workdir_both_finish(tmp_path, prefect_env):
    """Both generate-or-wait for the demo dataset under the store lock (the loser crashed with `Directory not
    empty`); stopping after the scan keeps the test short. On the worker's Prefect server, as two runs a user starts
    against one: the race is the dataset's, not a temporary server's (two of those cost ~20 CPU-s)."""
    env = prefect_env | {"PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tuneline.flows.cli", "run", "--until", "scan", "--workdir", str(tmp_path / "w")]
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=1200) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]


def test_a_non_terminal_log_of_the_demo_has_no_progress_bars_or_banners(demo_run):
    err = demo_run["stderr"]
    assert "\x1b[" not in err and "\r" not in err, "raw escape codes or carriage returns in the log"
    assert not re.search(r"\n\s*\n\s*\n", err), "runs of empty lines in the log"
    assert "Starting temporary server" not in err and "docs.prefect.io" not in err
    assert re.search(r"step \d+/\d+", err), "stage progress (training steps) is gone from the log"
