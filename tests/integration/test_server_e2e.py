"""A real Prefect server: `tuneline deploy`, a `--limit 1` worker, runs triggered through the API as the UI does.

One server (basic auth on) and one worker serve every test here, in file order: the pipeline run, a scheduled
rerun that must rebuild nothing, retries of failed stage runs, and the 401 for unauthenticated calls.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers import STAGES, prefect_cli, tuneline

pytestmark = pytest.mark.slow

AUTH = "tuneline:not-a-real-secret"
RUN_TIMEOUT = 300
# The sync client sends `sort`/`limit` as null unless given, which this server version refuses (422).
LIST = {"sort": "EXPECTED_START_TIME_ASC", "limit": 200}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """Kill the process group started for the test (server or worker, and their children)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _small_config(workdir: Path, **ops) -> dict:
    cfg = yaml.safe_load(tuneline("config", "example").stdout)
    cfg["workdir"] = str(workdir)
    cfg["train"].update(steps=4, processes=1)
    cfg["validate"].update(learning_check=False, steps=2)
    cfg["ops"].update(ops)
    return cfg


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-server")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = dict(
        os.environ,
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_API_AUTH_STRING=AUTH,
        PREFECT_SERVER_UI_ENABLED="false",
        # Auto-scheduled runs appear seconds after deploy instead of after the 60 s default loop.
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2",
    )
    log = open(home / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_healthy(url, proc, home / "server.log")
        client_env = {
            "PREFECT_API_URL": url,
            "PREFECT_API_AUTH_STRING": AUTH,
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-client")),
        }
        yield {"url": url, "env": client_env, "home": home}
    finally:
        _stop(proc)
        log.close()


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"prefect server exited:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"prefect server not healthy after 120 s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def deployed(server, tmp_path_factory):
    """`tuneline deploy` of the small demo (with a nightly schedule), then a worker with one slot.

    As a user does it: the config's workdir is relative and `deploy` runs from the config's folder; the worker
    starts in another directory (and runs each flow in a temporary one), so only resolved paths can work."""
    root = tmp_path_factory.mktemp("deployed")
    cfg_path = root / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(_small_config(Path("work"), schedule={"cron": "0 3 * * *"}, lock_timeout=0)))
    out = tuneline("deploy", cfg_path.name, env=server["env"], timeout=300, cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr
    log = open(root / "worker.log", "w")
    elsewhere = tmp_path_factory.mktemp("worker-cwd")
    # --limit 1: the pipeline must not deadlock waiting for its stage runs (they are in-process subflows).
    worker = subprocess.Popen(
        [sys.executable, "-m", "tuneline.flows.cli", "worker", "--limit", "1"],
        cwd=elsewhere,
        env=dict(os.environ, **server["env"], PYTHONPATH=str(Path(__file__).parents[2])),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield {
            "config": cfg_path,
            "workdir": root / "work",
            "root": root,
            "deploy_out": out.stdout,
            "worker_log": root / "worker.log",
        }
    finally:
        _stop(worker)
        log.close()


@pytest.fixture()
def client(server):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server["url"], PREFECT_API_AUTH_STRING: AUTH}):
        with get_client(sync_client=True) as c:
            yield c


def _deployment(client, stage: str):
    return client.read_deployment_by_name(f"tuneline-{stage}/tuneline-{stage}")


def _wait(client, run_id, log: Path, timeout: float = RUN_TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.read_flow_run(run_id)
        if run.state and run.state.is_final():
            return run
        time.sleep(1)
    raise AssertionError(f"flow run {run_id} not finished after {timeout} s; worker log:\n{log.read_text()[-4000:]}")


def _children(client, parent_id) -> dict[str, object]:
    """The stage flow runs a pipeline run started, by stage name."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])), **LIST
    )
    return {client.read_flow(r.flow_id).name.removeprefix("tuneline-"): r for r in runs}


def _artifacts(client, run_ids) -> dict[str, list[dict]]:
    """Artifacts of these flow runs by key (raw API: this client version sends nulls the server refuses)."""
    body = {
        "artifacts": {"flow_run_id": {"any_": [str(i) for i in run_ids]}},
        "sort": "CREATED_DESC",
        "limit": 200,
        "offset": 0,
    }
    out: dict[str, list[dict]] = {}
    for a in client.request("POST", "/artifacts/filter", json=body).json():
        out.setdefault(a["key"], []).append(a)
    return out


def _manifests(workdir: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in (workdir / "artifacts").glob("*/*/manifest.json")}


def _check_failed_then_retry(client, run_id, log: Path, expect: str, fix, env: dict) -> None:
    """The run failed for `expect`; after `fix()`, `prefect flow-run retry <id>` reruns it and it completes."""
    run = _wait(client, run_id, log)
    assert run.state.is_failed(), f"expected a failure, got {run.state}"
    assert expect in (run.state.message or ""), run.state.message
    fix()
    out = prefect_cli("flow-run", "retry", str(run_id), env=env)  # as docs/operations.md tells users
    assert out.returncode == 0, out.stdout + out.stderr
    again = _wait(client, run_id, log)
    assert again.state.is_completed(), f"retry ended {again.state}:\n{log.read_text()[-4000:]}"
    assert again.run_count >= 2


def test_deploy_registers_typed_deployments(deployed, client):
    for stage in [*STAGES, "pipeline"]:
        d = _deployment(client, stage)
        assert stage in d.name and d.work_pool_name == "tuneline"
        assert "PipelineConfig" in d.parameter_openapi_schema["definitions"]  # the UI renders it as a form
        assert Path(d.parameters["config"]["workdir"]) == deployed["workdir"]  # resolved where deploy ran
        assert Path(d.parameters["config"]["dataset"]["path"]) == deployed["workdir"] / "demo-data"
    assert [s.schedule.cron for s in _deployment(client, "pipeline").schedules] == ["0 3 * * *"]
    assert _deployment(client, "train").global_concurrency_limit.limit == 1
    assert client.read_global_concurrency_limit_by_name("tuneline-train").limit == 1
    assert client.read_work_pool("tuneline").type == "process"


def test_pipeline_deployment_runs_every_stage(deployed, client):
    run = client.create_flow_run_from_deployment(_deployment(client, "pipeline").id)
    run = _wait(client, run.id, deployed["worker_log"])
    assert run.state.is_completed(), f"{run.state}:\n{deployed['worker_log'].read_text()[-6000:]}"
    children = _children(client, run.id)
    assert sorted(children) == sorted(STAGES)
    assert all(r.state.is_completed() for r in children.values())
    rows = {
        r["stage"]: r
        for r in json.loads(tuneline("status", str(deployed["config"]), "--json", cwd=deployed["root"]).stdout)
    }
    assert all(rows[s]["state"] == "fresh" and Path(rows[s]["path"]).is_dir() for s in STAGES)
    keys = _artifacts(client, [run.id, *(r.id for r in children.values())])
    for key in [
        "lineage",
        "latents-cache",
        "train-loss",
        "validate-grid",
        "scan-buckets",
        *(f"{s}-summary" for s in STAGES),
    ]:
        assert key in keys, f"artifact {key} missing; got {sorted(keys)}"


def test_scheduled_run_without_changes_rebuilds_nothing(server, deployed, client):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.states import Scheduled

    pipeline = _deployment(client, "pipeline")
    deadline, planned = time.monotonic() + 60, []
    while not planned and time.monotonic() < deadline:  # the server's scheduler creates the nightly runs
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[pipeline.id])), **LIST
        )
        planned = [r for r in runs if r.auto_scheduled and r.state.is_scheduled()]
        time.sleep(1)
    # Prefect 3.8.8's scheduler cannot insert runs with SQLAlchemy 2.1 ("Can't evaluate bulk DML statement").
    assert planned, (
        "the cron schedule produced no scheduled run; server log:\n"
        + (server["home"] / "server.log").read_text()[-2000:]
    )
    before = _manifests(deployed["workdir"])
    started = time.monotonic()
    # Run the next nightly run now instead of at 03:00: the run the scheduler created, unchanged otherwise.
    client.set_flow_run_state(planned[0].id, Scheduled(message="run now"), force=True)
    run = _wait(client, planned[0].id, deployed["worker_log"])
    assert run.state.is_completed(), run.state
    assert _manifests(deployed["workdir"]) == before, "a stage was rebuilt although nothing changed"
    children = _children(client, run.id)
    summaries = _artifacts(client, [r.id for r in children.values()])
    for stage in STAGES:
        text = [a["data"] for a in summaries[f"{stage}-summary"]]
        assert text and all("fresh: reused as is" in t for t in text), f"{stage} was not skipped: {text}"
    print(f"scheduled no-change run: {time.monotonic() - started:.1f} s end to end")


def test_failed_stage_run_retried_after_the_cause_is_fixed(server, deployed, client):
    """Another process holds the store lock -> validate refuses naming it; released -> the retry of that same
    flow run completes, rebuilding validate from the published upstream versions (none of them rebuilt)."""
    from tuneline.stages.common.lock import store_lock

    before = _manifests(deployed["workdir"])
    validate = _deployment(client, "validate")
    with contextlib.ExitStack() as held:
        held.enter_context(store_lock(deployed["workdir"], timeout=0, purpose="the test holding the store"))
        run = client.create_flow_run_from_deployment(validate.id, parameters={"force": True})
        _check_failed_then_retry(
            client, run.id, deployed["worker_log"], f"pid {os.getpid()}", fix=held.close, env=server["env"]
        )
    # validate was built again (force) and replaced the version it already had; nothing upstream was touched.
    after = _manifests(deployed["workdir"])
    assert after.keys() == before.keys()
    assert {p.parts[-3] for p in after if after[p] != before[p]} == {"validate"}
    summary = [a["data"] for a in _artifacts(client, [run.id])["validate-summary"]]
    assert summary and "built in this run" in summary[0]


def test_failed_scan_run_retried_after_the_dataset_appears(server, deployed, client, tmp_path):
    cfg = _small_config(tmp_path / "work")
    cfg["dataset"].update(path=str(tmp_path / "photos"), demo=False)
    scan = _deployment(client, "scan")
    run = client.create_flow_run_from_deployment(scan.id, parameters={"config": cfg})
    src = deployed["workdir"] / "demo-data"
    _check_failed_then_retry(
        client,
        run.id,
        deployed["worker_log"],
        "dataset.path: " + str(tmp_path / "photos"),  # the same refusal the CLI makes before starting a run
        fix=lambda: shutil.copytree(src, tmp_path / "photos"),
        env=server["env"],
    )
    assert list((tmp_path / "work" / "artifacts" / "scan").glob("*/manifest.json"))


def test_prefects_own_cli_lists_what_we_registered(server, deployed):
    """The commands docs/operations.md points users to, against our server and pinned dependency set."""
    expect = {
        ("deployment", "ls"): "tuneline-pipeline",
        ("flow-run", "ls"): "COMPLETED",
        ("flow", "ls"): "tuneline-train",
        ("work-pool", "ls"): "tuneline",
        # failed and crashed (killed) runs, as docs/operations.md lists them for a retry
        ("flow-run", "ls", "--state", "FAILED", "--state", "CRASHED", "-o", "json"): "[",
    }
    for args, needle in expect.items():
        out = prefect_cli(*args, env=server["env"])
        assert out.returncode == 0 and "Unprocessable" not in out.stdout + out.stderr, (
            f"`prefect {' '.join(args)}` failed:\n{out.stdout[-1500:]}{out.stderr[-1500:]}"
        )
        assert needle in out.stdout, f"`prefect {' '.join(args)}` does not show {needle}:\n{out.stdout[-1500:]}"


def test_basic_auth_refuses_anonymous_calls(server):
    url = server["url"]
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # health stays open for probes
    assert httpx.post(f"{url}/flows/filter", json={}, timeout=5).status_code == 401
    assert httpx.post(f"{url}/flows/filter", json={}, auth=tuple(AUTH.split(":")), timeout=5).status_code == 200
