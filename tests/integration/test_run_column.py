"""The user's path for every registered family: `tuneline config example` with model.family, train.mode lora and
train.steps 2 changed (2 processes, as the example has) and dataset.path the session's demo folder (the same demo
dataset), run with `tuneline run --until train` through the real CLI against one Prefect server for the column.
Each run must publish a train artifact trained by 2 processes with its exports.

The scan, latents and text caches come from the session's upstream store (tests/upstream_store.py), keyed by
the config exactly as the CLI loads it, so the CLI finds them fresh and runs the train stage's flow only. On the
session's demo folder, they are the caches other tests built for the family (tests/integration/
test_train_families.py and others), not a build per family for this column.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.helpers import tuneline
from tests.integration.test_server_e2e import _free_port, _stop, _wait_healthy
from tuneline.schemas.config import load_config
from tuneline.schemas.train_manifest import TrainManifest
from tuneline.stages.common.artifacts import ArtifactStore
from tuneline.stages.families.registry import family_names, get_family


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One `prefect server start` for the column; the CLI calls reach it through PREFECT_API_URL."""
    home = tmp_path_factory.mktemp("prefect-server")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    log = open(home / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env | {"PREFECT_SERVER_UI_ENABLED": "false"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_healthy(url, proc, home / "server.log")
        yield {"PREFECT_API_URL": url, "PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-client"))}
    finally:
        _stop(proc)
        log.close()


@pytest.fixture(scope="module")
def example() -> dict:
    out = tuneline("config", "example")
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


# Two groups of families (tests/workers.py), so that the column runs on two xdist workers at once. Another layout of a
# family (FamilyFacts.variant_of: Wan 2.2's TI2V 5B) runs its family's CLI path: its scan -> validate run is
# tests/integration/test_wan22_ti2v.py, its 2-process training the matrix's cell.
COLUMN = [f for f in family_names() if not get_family(f).facts.variant_of]


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.group(f"run-column-{i % 2}")) for i, f in enumerate(COLUMN)]
)
def test_run_until_train(family, example, server, upstream_store, demo_data, tmp_path):
    data = example | {"workdir": str(tmp_path / "work")}
    data["model"] = data["model"] | {"family": family}
    data["train"] = data["train"] | {"mode": "lora", "steps": 2}
    data["dataset"] = data["dataset"] | {"path": str(demo_data)}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    cfg = load_config(path)
    upstream_store.upstream(cfg)
    out = tuneline("run", str(path), "--until", "train", env=server, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    store = ArtifactStore(cfg.workdir_path())
    manifest = store.read(store.latest("train"), TrainManifest)
    assert (manifest.family, manifest.step, manifest.world_size) == (family, 2, 2)
    assert manifest.exports, "the train artifact lists no exports"
    rebuilt = [s for s in ("scan", "latents", "text") if len(store.versions(s)) != 1]
    assert not rebuilt, f"the run rebuilt the store's fresh caches: {rebuilt}"
