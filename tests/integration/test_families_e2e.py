"""Every family's tiny flavor through the whole pipeline (scan -> latents -> text -> train -> validate), stage by
stage through the runner the flows use, without Prefect; with the text cache (caption dropout + variants) and
without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from tests.integration.family_runs import run_all, write_dataset
from tuneline.schemas.config import parse_config
from tuneline.schemas.text import TextManifest
from tuneline.schemas.train_manifest import TrainManifest
from tuneline.schemas.validate import ValidateManifest
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.pipeline import PIPELINE, stages_for


def pipeline_config(root: Path, family: str, text: dict) -> StageContext:
    """64 px, 2 steps, 1 process, 2 sampler steps: the smallest run that still crosses every stage boundary."""
    write_dataset(root / "data")
    cfg = parse_config(
        {
            "dataset": {"path": str(root / "data")},
            "model": {"family": family, "path": None, "device": "cpu"},
            "buckets": {"resolution": 64},
            "text": text,
            "train": {"steps": 2, "batch_size": 2, "processes": 1, "caption_dropout": 0.5},
            "validate": {"steps": 2, "prompts": [{"prompt": "red, square", "negative_prompt": "blue", "seed": 1}]},
        },
        workdir=str(root / "work"),
    )
    return StageContext(cfg)


def check_results(ctx: StageContext, paths: dict[str, Path]) -> None:
    store = ctx.store
    train = store.read(paths["train"], TrainManifest)
    assert (train.family, train.step, train.world_size) == (ctx.cfg.model.family, 2, 1)
    index = json.loads((paths["train"] / "final" / "model_index.json").read_text())
    assert index["_class_name"].endswith("Pipeline")
    val = store.read(paths["validate"], ValidateManifest)
    assert [(i.prompt, i.negative_prompt, i.seed) for i in val.images] == [("red, square", "blue", 1)]
    with Image.open(paths["validate"] / val.images[0].file) as img:
        assert img.size == (64, 64)
    assert (paths["validate"] / val.grid).is_file()
    assert all(run_stage(ctx, sd, PIPELINE)[1] is False for sd in stages_for(ctx.cfg)), (
        "a second run must skip every stage"
    )


@pytest.mark.parametrize("family", ["sd15", "sdxl", "sd3", "flux"])
def test_family_pipeline_with_text_cache(family, tmp_path):
    """Cached text with caption dropout (the cached empty caption) and two shuffled variants per caption."""
    ctx = pipeline_config(tmp_path, family, {"caption_variants": 2, "shuffle_tags": True})
    paths = run_all(ctx)
    text = ctx.store.read(paths["text"], TextManifest)
    assert text.enabled and text.variants == 2 and text.count >= 4
    check_results(ctx, paths)


def test_pipeline_with_text_cache_off(tmp_path):
    """text.enabled false: the text artifact records settings only; training and validation encode live."""
    ctx = pipeline_config(tmp_path, "sd15", {"enabled": False})
    paths = run_all(ctx)
    text = ctx.store.read(paths["text"], TextManifest)
    assert not text.enabled and not text.fields
    check_results(ctx, paths)
