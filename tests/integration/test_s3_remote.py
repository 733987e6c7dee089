"""Artifact versions on S3-compatible storage (a loopback moto server): push, pull with checksums, zarr over fsspec."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from tests.helpers import tuneline
from tuneline.flows.cli import app

BUCKET = "tuneline-test"
CREDS = {"key": "test-key", "secret": "test-secret"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=CREDS["key"],
        aws_secret_access_key=CREDS["secret"],
    ).create_bucket(Bucket=BUCKET)
    try:
        yield endpoint
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _credentials(monkeypatch):
    """Secrets come from the environment, never from the config."""
    monkeypatch.setenv("TUNELINE_REMOTE_OPTIONS", json.dumps(CREDS))


@pytest.fixture(scope="module")
def built(tmp_path_factory, s3):
    """scan + latents of the demo dataset, run in-process (no Prefect needed for the store itself)."""
    from tuneline.schemas.config import demo_config
    from tuneline.stages.common.stage import StageContext, run_stage
    from tuneline.stages.pipeline import PIPELINE, stage
    from tuneline.stages.scan.demo import write_demo_dataset

    workdir = tmp_path_factory.mktemp("s3-src") / "work"
    cfg = demo_config(str(workdir))
    write_demo_dataset(cfg.resolve(cfg.dataset.path))
    ctx = StageContext(cfg)
    paths = {name: run_stage(ctx, stage(name), PIPELINE)[0] for name in ("scan", "latents")}
    return {"cfg": cfg, "paths": paths}


def _remote(endpoint: str, prefix: str):
    from tuneline.stages.common.remote import Remote

    return Remote(f"s3://{BUCKET}/{prefix}", {"endpoint_url": endpoint})


def test_push_then_pull_gives_an_identical_verified_version(built, s3, tmp_path):
    from tuneline.schemas.latents import LatentsManifest
    from tuneline.stages.common.artifacts import ArtifactStore

    remote, src = _remote(s3, "roundtrip"), built["paths"]["latents"]
    store = ArtifactStore(built["cfg"].workdir_path())
    assert remote.push(store, "latents", src.name) is True
    assert remote.push(store, "latents", src.name) is False  # immutable: never re-sent
    assert remote.versions("latents") == [src.name]
    dest = ArtifactStore(tmp_path / "work")
    pulled = remote.pull(dest, "latents", src.name)
    assert pulled == dest.version_dir("latents", src.name)
    dest.read(pulled, LatentsManifest, full=True)  # every checksum, as a consumer checks it
    files = sorted(p.relative_to(src) for p in src.rglob("*"))
    assert sorted(p.relative_to(pulled) for p in pulled.rglob("*")) == files
    assert not [p for p in dest.stage_dir("latents").iterdir() if p.name.startswith(".")]


def test_interrupted_push_is_invisible_and_redone(built, s3, tmp_path, monkeypatch):
    from tuneline.stages.common.artifacts import ArtifactStore
    from tuneline.stages.common.remote import RemoteError

    remote, src = _remote(s3, "interrupted"), built["paths"]["scan"]
    store = ArtifactStore(built["cfg"].workdir_path())

    def die(*_a, **_k):
        raise ConnectionError("network gone before the manifest")

    monkeypatch.setattr(remote.fs, "pipe_file", die)
    with pytest.raises(ConnectionError):
        remote.push(store, "scan", src.name)
    assert remote.fs.ls(f"{BUCKET}/interrupted/scan/{src.name}"), "the data files were uploaded"
    assert remote.versions("scan") == []  # ...but without its manifest the version does not exist
    with pytest.raises(RemoteError, match="never pushed or its push was interrupted"):
        remote.pull(ArtifactStore(tmp_path), "scan", src.name)
    monkeypatch.undo()
    assert remote.push(store, "scan", src.name) is True
    assert remote.versions("scan") == [src.name]


def test_pull_refuses_a_corrupted_remote_file(built, s3, tmp_path):
    from tuneline.stages.common.artifacts import ArtifactStore
    from tuneline.stages.common.remote import RemoteError

    remote, src = _remote(s3, "corrupt"), built["paths"]["scan"]
    remote.push(ArtifactStore(built["cfg"].workdir_path()), "scan", src.name)
    key = f"{BUCKET}/corrupt/scan/{src.name}/images.jsonl"
    data = remote.fs.cat_file(key)
    remote.fs.pipe_file(key, data.replace(b'"caption"', b'"captioN"', 1))  # same size, different bytes
    dest = ArtifactStore(tmp_path)
    with pytest.raises(RemoteError, match="images.jsonl does not match its SHA-256"):
        remote.pull(dest, "scan", src.name)
    assert not dest.stage_dir("scan").exists() or not list(dest.stage_dir("scan").iterdir()), "nothing left behind"


def test_zarr_latents_open_straight_from_the_s3_url(built, s3):
    """What the training reader needs: zarr reads the cache through fsspec from the version's URL."""
    import zarr

    from tuneline.stages.common.artifacts import ArtifactStore

    remote, src = _remote(s3, "zarr"), built["paths"]["latents"]
    remote.push(ArtifactStore(built["cfg"].workdir_path()), "latents", src.name)
    manifest = json.loads((src / "manifest.json").read_text())
    for b in manifest["buckets"]:
        url = f"{remote.version_url('latents', src.name)}/{manifest['store']}/{b['array']}"
        remote_group = zarr.open_group(url, mode="r", storage_options=remote.options)
        local_group = zarr.open_group(str(src / manifest["store"] / b["array"]), mode="r")
        assert remote_group["mean"].shape == (b["count"], *b["shape"])
        np.testing.assert_array_equal(remote_group["mean"][:], local_group["mean"][:])
        np.testing.assert_array_equal(remote_group["std"][:8], local_group["std"][:8])


def test_cli_pushes_on_publish_and_pulls(built, s3, tmp_path, prefect_server):
    """`ops.remote` set: a stage run pushes what it publishes; `remote ls/pull` fetch it into another workdir."""
    cfg = built["cfg"].dump()
    cfg["ops"].update(remote=f"s3://{BUCKET}/cli", remote_options={"endpoint_url": s3})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tuneline("stage", "scan", str(path), timeout=600, env=prefect_server)
    assert out.returncode == 0, out.stderr[-3000:]
    version = Path(out.stdout.strip().splitlines()[-1]).name
    cli = CliRunner()  # the remote commands in-process: no Prefect involved, and much faster
    assert f"s3://{BUCKET}/cli/scan/{version}" in cli.invoke(app, ["remote", "ls", str(path)]).stdout
    other = tmp_path / "elsewhere"
    pulled = cli.invoke(app, ["remote", "pull", "scan", version, str(path), "--workdir", str(other)])
    assert pulled.exit_code == 0, pulled.output
    assert (other / "artifacts" / "scan" / version / "manifest.json").is_file()
    missing = cli.invoke(app, ["remote", "pull", "scan", "0000000000000000", str(path), "--workdir", str(other)])
    assert missing.exit_code == 1 and "never pushed" in missing.output
