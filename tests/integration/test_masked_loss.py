"""Masked loss (dataset.masks + train.masked_loss): scanned, cached at the latent grid, weighting the loss."""

from __future__ import annotations

import json

import numpy as np
import torch
from PIL import Image

from tests.integration.test_train_support import build_upstream, small_config
from tests.trainer import steps, trainer_for
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.latents.masks import mask_file
from tuneline.stages.scan.demo import write_demo_dataset

TRAIN = {"steps": 2, "processes": 1, "batch_size": 2, "masked_loss": True, "caption_dropout": 0.0}


def _masks(cfg, folder, value: int, shrink: str | None = None) -> None:
    """One mask per demo image, all `value`; the image named `shrink` gets a mask of the wrong size. Each test's
    own dataset and masks (not the shared store's): the masks are what its caches differ by."""
    data = cfg.resolve(cfg.dataset.path)
    write_demo_dataset(data)
    folder.mkdir()
    for img in sorted(data.glob("*.png")):
        size = Image.open(img).size
        if img.stem == shrink:
            size = (size[0] // 2, size[1])
        Image.new("L", size, value).save(folder / f"{img.stem}.png")


def _params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.params.items()}


def test_a_zero_mask_leaves_the_weights_unchanged_and_a_full_one_trains(tmp_path):
    for value, changes in ((0, False), (255, True)):
        work = tmp_path / str(value)
        cfg = small_config(work, TRAIN, dataset={"masks": str(work / "masks")})
        _masks(cfg, work / "masks", value)
        ctx = build_upstream(cfg)
        lat = ctx.store.latest("latents")
        manifest = json.loads((lat / "manifest.json").read_text())
        assert manifest["masked"] == manifest["count"] > 0
        bucket = manifest["buckets"][0]
        planes = np.load(mask_file(lat, bucket["array"]))
        assert planes.shape == (bucket["count"], *bucket["shape"][1:]) and np.all(planes == value / 255)
        trainer = trainer_for(cfg, ctx)
        before = _params(trainer)
        steps(trainer, 2)
        moved = any(not torch.equal(before[n], p) for n, p in _params(trainer).items())
        assert moved == changes


def test_a_mask_of_another_size_is_rejected_naming_both_files(tmp_path):
    cfg = small_config(tmp_path, TRAIN, dataset={"masks": str(tmp_path / "masks")})
    data = cfg.resolve(cfg.dataset.path)
    write_demo_dataset(data)
    victim = sorted(data.glob("*.png"))[0].stem
    _masks(cfg, tmp_path / "masks", 255, shrink=victim)
    ctx = build_upstream(cfg)
    rejected = list(read_jsonl(ctx.store.latest("scan") / "rejected.jsonl"))
    assert [r["kind"] for r in rejected] == ["mask"]
    assert f"{victim}.png" in rejected[0]["reason"] and rejected[0]["path"] == f"{victim}.png"
    assert str(tmp_path / "masks" / f"{victim}.png") in rejected[0]["reason"]
