"""WebDataset shards in object storage (the suite's loopback moto server): the scan lists the prefix and reads
shards through fsspec with secrets from the environment, a scheduled rescan reads only the shard that landed,
the latents stage caches every image from its byte range (the same pixels as from a local copy), and the
caches train."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.integration.test_s3_remote import BUCKET, CREDS, s3  # noqa: F401  (s3: the moto server fixture)
from tests.integration.test_shard_sources import write_parquet, write_shard
from tests.trainer import steps, trainer_for
from tuneline.schemas.config import parse_config
from tuneline.schemas.demo import DEMO_CONFIG
from tuneline.schemas.scan import ImageRecord, Location, ScanManifest
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.remote import OPTIONS_ENV, Remote
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.latents.encode import prepare
from tuneline.stages.pipeline import PIPELINE, stage


@pytest.fixture(autouse=True)
def _credentials(monkeypatch):
    """Secrets come from the environment, never from the config."""
    monkeypatch.setenv(OPTIONS_ENV, json.dumps(CREDS))


def _config(workdir: Path, path: str, storage_options: dict | None = None):
    raw = json.loads(json.dumps(DEMO_CONFIG))
    raw["workdir"] = str(workdir)
    raw["dataset"] = {"path": path, "demo": False, "storage_options": storage_options or {}}
    return parse_config(raw, "<test>")


def _build(cfg, *names: str) -> dict[str, Path]:
    ctx = StageContext(cfg)
    return {name: run_stage(ctx, stage(name), PIPELINE)[0] for name in names}


def test_shards_on_s3_scan_incrementally_cache_the_same_latents_as_locally_and_train(tmp_path, s3):  # noqa: F811
    local = tmp_path / "shards"
    local.mkdir()
    write_shard(local / "000000.tar", 0, 4)
    write_shard(local / "000001.tar", 4, 4, json_captions=True)
    remote = Remote(f"s3://{BUCKET}/data", {"endpoint_url": s3})
    for shard in sorted(local.iterdir()):
        remote.fs.put_file(str(shard), f"{BUCKET}/data/weekly/{shard.name}")
    url = f"s3://{BUCKET}/data/weekly"
    cfg = _config(tmp_path / "work", url, {"endpoint_url": s3})
    assert cfg.dataset.path == url  # a URL is not resolved against the workdir
    built = _build(cfg, "scan", "latents")
    scan_manifest = json.loads((built["scan"] / "manifest.json").read_text())
    assert scan_manifest["dataset_root"] == url and "key" not in json.dumps(scan_manifest["storage_options"])
    assert sorted(scan_manifest["shards_read"]) == ["000000.tar", "000001.tar"]
    records = list(read_jsonl(built["scan"] / "images.jsonl"))
    assert len(records) == 8 and all(r["offset"] is not None for r in records)

    latents = json.loads((built["latents"] / "manifest.json").read_text())
    assert sum(b["count"] for b in latents["buckets"]) == 8 and not list(
        read_jsonl(built["latents"] / "rejected.jsonl")
    )
    # What the latents stage encoded from byte ranges of the objects is what a local copy of the shards gives.
    roots = ScanManifest.model_validate(scan_manifest).roots()
    assert isinstance(roots[None], Location)
    for rec in map(ImageRecord.model_validate, records):
        remote_pixels, local_pixels = prepare(roots[None], rec), prepare(local, rec)
        assert not isinstance(remote_pixels, str) and torch.equal(remote_pixels, local_pixels)

    _build(cfg, "text")  # and it trains on them (the in-process trainer over the published caches)
    trainer = trainer_for(cfg, StageContext(cfg))
    steps(trainer, 2)
    assert len(trainer.losses) == 2 and all(map(math.isfinite, trainer.losses))

    write_shard(local / "000002.tar", 8, 2)  # next week's shard lands in the bucket
    remote.fs.put_file(str(local / "000002.tar"), f"{BUCKET}/data/weekly/000002.tar")
    again = _build(cfg, "scan")
    manifest = json.loads((again["scan"] / "manifest.json").read_text())
    assert manifest["shards_read"] == ["000002.tar"] and manifest["accepted"] == 10


def test_a_parquet_table_on_s3_is_read_by_row_group(tmp_path, s3):  # noqa: F811
    table = tmp_path / "train.parquet"
    write_parquet(table, 5)
    remote = Remote(f"s3://{BUCKET}/tables", {"endpoint_url": s3})
    remote.fs.put_file(str(table), f"{BUCKET}/tables/train.parquet")
    cfg = _config(tmp_path / "work", f"s3://{BUCKET}/tables/train.parquet", {"endpoint_url": s3})
    built = _build(cfg, "scan")
    records = [ImageRecord.model_validate(r) for r in read_jsonl(built["scan"] / "images.jsonl")]
    assert [(r.row_group, r.row, r.caption) for r in records][:3] == [(0, 0, "row 0"), (0, 1, "row 1"), (1, 0, "row 2")]
    roots = ScanManifest.model_validate_json((built["scan"] / "manifest.json").read_text()).roots()
    for rec in records:
        assert torch.equal(prepare(roots[None], rec), prepare(table, rec))
