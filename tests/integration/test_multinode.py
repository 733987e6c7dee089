"""Two nodes on one machine: two `tuneline stage train` processes (train.nodes 2, node ranks 0 and 1, c10d
rendezvous on 127.0.0.1) sharing one workdir, as the Kubernetes template's shared volume does. Neither waits on
the other for the store lock, the node holding global rank 0 publishes once, the other finishes with success;
killed mid-run and started again, both continue the same checkpoint to the uninterrupted run's weights."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers import spawn
from tests.integration.test_train_support import ROOT, small_config
from tuneline.schemas.train_manifest import TrainManifest
from tuneline.stages.common.stage import StageContext, status
from tuneline.stages.pipeline import PIPELINE

pytestmark = [pytest.mark.slow, pytest.mark.ddp(reason="two nodes of two ranks: multi-node rendezvous and resume")]
# 2 nodes x 2 processes x batch 2: world 4, a global batch of 8 of a bucket's 24 images.
TRAIN = {
    "steps": 6,
    "checkpoint_every": 2,
    "batch_size": 2,
    "processes": 2,
    "nodes": 2,
    "rdzv_endpoint": "127.0.0.1:29999",
    "keep_checkpoints": 3,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_nodes(wd: Path, port: int, data: Path, server: dict) -> list[subprocess.Popen]:
    procs = []
    for rank in (0, 1):
        train = {**TRAIN, "node_rank": rank, "rdzv_endpoint": f"127.0.0.1:{port}"}
        cfg = small_config(wd, train, dataset={"path": str(data)}).dump()
        path = wd / f"node{rank}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        # Each node is its own machine: its own Prefect home, one shared workdir, the cluster's one Prefect server
        # (where both nodes' train stages ask for the training slot: the training takes one, node 0's).
        env = {**server, "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(wd / f"prefect-{rank}")}
        log = open(wd / f"node{rank}.log", "w")
        procs.append(spawn([sys.executable, "-m", "tuneline.flows.cli", "stage", "train", str(path)], log, env))
    return procs


def _logs(wd: Path) -> str:
    return "\n".join(f"--- node {r}\n" + (wd / f"node{r}.log").read_text()[-3000:] for r in (0, 1))


def _finish(wd: Path, procs: list[subprocess.Popen]) -> list[int]:
    try:
        return [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def _published(wd: Path) -> list[Path]:
    d = wd / "artifacts" / "train"
    return [p for p in d.iterdir() if not p.name.startswith(".") and (p / "manifest.json").is_file()]


def _weights(version: Path) -> dict[str, torch.Tensor]:
    return load_file(str(version / "final" / "unet" / "diffusion_pytorch_model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, upstream_store, demo_data, prefect_server) -> Path:
    wd = tmp_path_factory.mktemp("two-nodes")
    upstream_store.upstream(small_config(wd, TRAIN, dataset={"path": str(demo_data)}))
    codes = _finish(wd, _start_nodes(wd, _free_port(), demo_data, prefect_server))
    assert codes == [0, 0], _logs(wd)
    return wd


def test_two_nodes_train_and_publish_once(uninterrupted, demo_data):
    wd = uninterrupted
    published = _published(wd)
    assert len(published) == 1, published
    manifest = TrainManifest.model_validate_json((published[0] / "manifest.json").read_text())
    assert manifest.world_size == 4 and manifest.step == TRAIN["steps"]
    logs = _logs(wd)
    assert "global rank 0 trained on another node, which published" in logs, logs
    rows = {
        r.stage: r.state
        for r in status(StageContext(small_config(wd, TRAIN, dataset={"path": str(demo_data)})), PIPELINE)
    }
    assert rows["train"] == "fresh"
    assert not list((wd / "artifacts" / "train").glob(".*.partial")), "the publisher's work folder was left behind"


def test_two_nodes_killed_mid_run_resume_to_the_same_weights(
    uninterrupted, tmp_path, upstream_store, demo_data, prefect_server
):
    wd = tmp_path
    upstream_store.upstream(small_config(wd, TRAIN, dataset={"path": str(demo_data)}))
    procs = _start_nodes(wd, _free_port(), demo_data, prefect_server)
    deadline = time.monotonic() + 400
    try:
        while not list(wd.glob("artifacts/train/.*.partial/checkpoints/step-0000002")):
            assert all(p.poll() is None for p in procs), _logs(wd)
            assert time.monotonic() < deadline, "no checkpoint appeared:\n" + _logs(wd)
            time.sleep(0.05)
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert not _published(wd)
    # Node 0's slot of the killed run frees when its lease runs out (the server's repossessor, within a minute).
    codes = _finish(wd, _start_nodes(wd, _free_port(), demo_data, prefect_server))
    assert codes == [0, 0], _logs(wd)
    (version,) = _published(wd)
    manifest = json.loads((version / "manifest.json").read_text())
    assert manifest["resumed_from"] and Path(manifest["resumed_from"]).name.startswith("step-")
    (reference,) = _published(uninterrupted)
    want, got = _weights(reference), _weights(version)
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
