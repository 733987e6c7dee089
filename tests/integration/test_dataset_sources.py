"""dataset.sources: several folders with repeats, a regularization set with its loss weight, and train.eval.path,
carried through scan records, the caches and training (exact per-epoch counts, reported in the train manifest)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from tests.integration.test_train_support import small_config
from tests.trainer import trainer_for
from tuneline.schemas.latents import LatentsManifest
from tuneline.schemas.scan import ImageRecord, ScanManifest
from tuneline.schemas.sources import dataset_sources
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.latents.reader import LatentReader
from tuneline.stages.pipeline import PIPELINE, stage
from tuneline.stages.train.plan import MicroBatch, Position
from tuneline.stages.train.rows import RowPlan

pytestmark = pytest.mark.slow
COLORS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 180, 40), "yellow": (235, 215, 30)}


def _folder(root, names, caption, ext=".txt"):
    root.mkdir(parents=True)
    for i, name in enumerate(names):
        Image.new("RGB", (64, 64), COLORS[caption.split()[1]]).save(root / f"{name}.png")
        (root / f"{name}{ext}").write_text(f"{caption} {i}")


def _cfg(w, **train):
    sources = [
        {"path": "subject", "repeats": 2},
        {"path": "reg", "role": "regularization", "loss_weight": 0.5, "caption_extension": ".caption"},
    ]
    return small_config(
        w,
        {
            "processes": 1,
            "batch_size": 1,
            "steps": 11,
            "checkpoint_every": 11,
            "eval": {"path": "held", "every_steps": 11, "timesteps": [500]},
            **train,
        },
        dataset={"path": None, "demo": False, "sources": sources},
        model={"device": "cpu"},
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    w = tmp_path_factory.mktemp("sources") / "w"
    _folder(w / "subject", ["a0", "a1", "a2", "a3"], "a red square")
    _folder(w / "reg", ["a0", "a1", "a2"], "a blue square", ext=".caption")  # the same names as the subject's
    _folder(w / "held", ["h0", "h1"], "a green square")
    cfg = _cfg(w)
    ctx = StageContext(cfg)
    paths = {name: run_stage(ctx, stage(name), PIPELINE)[0] for name in ("scan", "latents", "text", "train")}
    return cfg, ctx, paths


def test_records_name_their_folder_and_each_folder_its_captions(built):
    cfg, ctx, paths = built
    scan = ctx.store.read(paths["scan"], ScanManifest)
    records = [ImageRecord.model_validate(r) for r in read_jsonl(paths["scan"] / "images.jsonl")]
    assert Counter(r.source for r in records) == {0: 4, 1: 3, 2: 2}
    assert {r.resolution for r in records} == {cfg.buckets.resolution}
    assert {r.caption for r in records if r.source == 1} == {f"a blue square {i}" for i in range(3)}
    assert {r.path for r in records if r.source == 1} <= {r.path for r in records if r.source == 0}
    assert [(s.role, s.images) for s in scan.sources] == [("train", 4), ("regularization", 3), ("eval", 2)]
    lat = ctx.store.read(paths["latents"], LatentsManifest)
    assert lat.count == 9  # identical relative paths in two folders are two images


def test_repeats_are_exact_per_epoch_and_eval_images_never_train(built):
    cfg, ctx, paths = built
    lat = ctx.store.read(paths["latents"], LatentsManifest)
    reader = LatentReader(paths["latents"], lat)
    rows = RowPlan(reader, cfg.train, dataset_sources(cfg))
    for epoch in (0, 1):
        seen = Counter(reader.paths[b][r].split("//")[0] for b, batch in rows.plan(epoch, 1) for r in batch)
        assert seen == {"0": 8, "1": 3}
    held = [reader.paths[b][r] for b, rs in rows.held_rows().items() for r in rs]
    assert sorted(held) == ["2//h0.png", "2//h1.png"]
    manifest = json.loads((paths["train"] / "manifest.json").read_text())
    assert [(s["role"], s["samples"]) for s in manifest["seen_per_source"]] == [("train", 8), ("regularization", 3)]
    assert [e["step"] for e in manifest["eval_losses"]] == [11]


def test_regularization_loss_is_weighted_by_its_source(built):
    cfg, ctx, _ = built
    losses = []
    for weight in (1.0, 0.5):
        srcs = [
            s if s.role != "regularization" else dataclasses.replace(s, loss_weight=weight)
            for s in dataset_sources(cfg)
        ]
        trainer = trainer_for(cfg, ctx)
        reader = trainer.data.reader
        bucket, refs = next(iter(reader.paths.items()))
        reg = np.array([i for i, r in enumerate(refs) if r.startswith("1//")][:1])
        trainer.data.rows = RowPlan(reader, cfg.train, srcs)
        losses.append(float(trainer.micro_step(trainer.prepare(0, MicroBatch(bucket, reg, reg, Position())), True)))
    assert losses[1] == pytest.approx(0.5 * losses[0], rel=1e-5) and losses[0] > 0
