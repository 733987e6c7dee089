"""buckets.resolutions: every image bucketed and cached at each resolution, and trained from all of them."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from tests.integration.test_train_support import small_config
from tests.trainer import trainer_for
from tuneline.schemas.config import ConfigError
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.train.plan import micro_batches

TRAIN = {"steps": 4, "processes": 1, "batch_size": 2}


def test_both_resolutions_are_cached_and_trained(tmp_path, upstream_store, demo_data):
    cfg = small_config(tmp_path, TRAIN, buckets={"resolutions": [64, 32]}, dataset={"path": str(demo_data)})
    ctx = upstream_store.upstream(cfg)
    records = list(read_jsonl(ctx.store.latest("scan") / "images.jsonl"))
    per_image = Counter(r["path"] for r in records)
    assert set(per_image.values()) == {2} and {r["resolution"] for r in records} == {32, 64}
    assert all(min(r["bucket_width"], r["bucket_height"]) == r["resolution"] for r in records)
    lat = json.loads((ctx.store.latest("latents") / "manifest.json").read_text())
    assert lat["count"] == len(records)
    assert {min(b["width"], b["height"]) for b in lat["buckets"]} == {32, 64}
    trainer = trainer_for(cfg, ctx)
    reader, t = trainer.data.reader, cfg.train
    epoch = reader.plan(t.batch_size, 1, t.seed, 0)
    stream = micro_batches(lambda e: reader.plan(t.batch_size, 1, t.seed, e), t.batch_size, 0)
    shapes = set()
    feed = trainer.feed(stream)
    for _ in range(len(epoch)):
        fed = next(feed)
        shapes.add(reader.shapes[fed.mb.bucket][1:])
        assert torch.isfinite(torch.tensor(trainer.train_step([fed])))
    feed.close()
    assert len({min(s) for s in shapes}) == 2  # latents of both resolutions went through a training step


def test_resolutions_must_include_resolution(tmp_path):
    with pytest.raises(ConfigError, match="buckets.resolutions .* must include buckets.resolution 64"):
        small_config(tmp_path, TRAIN, buckets={"resolutions": [32, 128]})
