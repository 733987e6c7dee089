"""A sharded latents stage on a Prefect work pool: a real `prefect server` (the session's), `tuneline deploy`, two
one-slot process workers; `tuneline stage latents` (holding no worker slot) runs each shard as a flow run of
`tuneline-shard` and publishes one version listing both shards."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import yaml

from tests.helpers import tuneline
from tests.integration.test_latents_stage import tiny_model_dir, write_images
from tests.integration.test_server_e2e import _stop
from tuneline.schemas.config import parse_config
from tuneline.schemas.latents import LatentsManifest
from tuneline.stages.common.artifacts import ArtifactStore

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(prefect_server):
    """The session's Prefect server; the workers poll it every second (a worker setting) so shards start at once."""
    return {"url": prefect_server["PREFECT_API_URL"], "env": prefect_server | {"PREFECT_WORKER_QUERY_SECONDS": "1"}}


def test_shards_run_as_flow_runs_on_two_workers_and_publish_one_version(server, tmp_path, tmp_path_factory):
    write_images(tmp_path / "data", range(16))
    (tmp_path / "work").mkdir()
    os.symlink(tiny_model_dir(tmp_path_factory.getbasetemp()), tmp_path / "work" / "models")
    cfg = {
        "workdir": str(tmp_path / "work"),
        "dataset": {"path": str(tmp_path / "data")},
        "model": {"family": "tiny", "device": "cpu"},
        "latents": {"block_rows": 4, "shards": 2, "workers": 1},
        "ops": {"shard_pool": "shards", "lock_timeout": 0},
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    out = tuneline("deploy", str(config), env=server["env"], timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    workers, logs = [], []
    try:
        for i in range(2):
            logs.append(open(tmp_path / f"worker-{i}.log", "w"))
            workers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tuneline.flows.cli", "worker", "--pool", "shards", "--limit", "1"],
                    cwd=tmp_path_factory.mktemp("worker-cwd"),
                    env=dict(os.environ, **server["env"]),
                    stdout=logs[-1],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        for name in ("scan", "latents"):
            out = tuneline("stage", name, str(config), env=server["env"], timeout=600)
            worker_logs = "".join((tmp_path / f"worker-{i}.log").read_text()[-3000:] for i in range(2))
            assert out.returncode == 0, out.stdout + out.stderr + worker_logs
    finally:
        for w in workers:
            _stop(w)
        for f in logs:
            f.close()
    store = ArtifactStore(parse_config(cfg).workdir_path())
    assert len(store.versions("latents")) == 1
    m = store.read(store.latest("latents"), LatentsManifest)
    assert [s.index for s in m.shards] == [0, 1] and sum(s.encoded for s in m.shards) == m.count == 16
    body = {"flow_runs": {"name": {"like_": "latents-shard-"}}, "limit": 10, "offset": 0}
    runs = httpx.post(f"{server['url']}/flow_runs/filter", json=body).json()
    assert sorted(r["name"] for r in runs) == ["latents-shard-0-of-2", "latents-shard-1-of-2"]
    assert all(r["state_type"] == "COMPLETED" for r in runs)
