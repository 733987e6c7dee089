"""When is a stage rebuilt: one row per change a user makes, and the stages that must be built again (docs/artifacts.md's
table). A workdir is built once; each row changes a copy, reruns the scan as a scheduled run would, and reads
which stages are no longer fresh. Moved folders, stray files, touched files, settings that change no record and
the same weights in another folder rebuild nothing."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from PIL import Image

from tests.integration.test_train_support import small_config
from tuneline.schemas.config import parse_config
from tuneline.stages.common.stage import StageContext, run_stage, status
from tuneline.stages.families.registry import get_family
from tuneline.stages.pipeline import PIPELINE, stage

pytestmark = pytest.mark.slow
DOWNSTREAM = {"latents", "text", "train", "validate"}


def _cfg(workdir: Path, **edits):
    data = small_config(
        workdir,
        {"steps": 2, "processes": 1, "checkpoint_every": 2, "validate_every": 0},
        model={"path": "model", "device": "cpu"},
        validate={"steps": 2},
    ).dump()
    data["dataset"]["demo"] = False
    for dotted, value in edits.items():
        section, key = dotted.split(".")
        data[section][key] = value
    data["workdir"] = str(workdir)
    return parse_config(data)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    from tuneline.stages.scan.demo import write_demo_dataset

    wd = tmp_path_factory.mktemp("table") / "w"
    shutil.copytree(get_family("tiny").ensure_model(None, wd / "models"), wd / "model")
    cfg = _cfg(wd)
    write_demo_dataset(cfg.resolve(cfg.dataset.path))
    ctx = StageContext(cfg)
    for name in ("scan", "latents", "text", "train", "validate"):
        run_stage(ctx, stage(name), PIPELINE)
    return wd


def _images(w: Path) -> list[Path]:
    return sorted(p for p in (w / "demo-data").rglob("*.png"))


def move_dataset(w):
    (w / "demo-data").rename(w / "photos")
    return {"dataset.path": "photos"}


def stray_file(w):
    (w / "demo-data" / "Thumbs.db").write_bytes(b"\0" * 100)


def touch_image(w):
    os.utime(_images(w)[0], ns=(1, 10**18))


def replace_image(w):
    Image.new("RGB", (64, 64), (12, 200, 90)).save(_images(w)[0])


def edit_caption(w):
    caption = _images(w)[0].with_suffix(".txt")
    caption.write_text(caption.read_text() + " on a table")


def seed_under_center_crop(w):
    return {"buckets.seed": 1234}


def resolution(w):
    return {"buckets.resolution": 128}


def model_copied_elsewhere(w):
    shutil.copytree(w / "model", w / "model-copy")
    return {"model.path": "model-copy"}


def vae_weights(w):
    f = next((w / "model" / "vae").glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))


def prediction_type(w):
    f = w / "model" / "scheduler" / "scheduler_config.json"
    f.write_text(json.dumps(json.loads(f.read_text()) | {"prediction_type": "v_prediction"}))


def validate_device(w):
    return {"model.device": "auto"}


TABLE = [
    (move_dataset, set()),
    (stray_file, set()),
    (touch_image, set()),
    (replace_image, DOWNSTREAM),
    (edit_caption, DOWNSTREAM),
    (seed_under_center_crop, set()),
    (resolution, DOWNSTREAM),
    (model_copied_elsewhere, set()),
    (vae_weights, {"latents", "train", "validate"}),
    (prediction_type, {"train", "validate"}),
    (validate_device, {"validate"}),
]


@pytest.mark.parametrize("change,rebuilt", TABLE, ids=[c.__name__ for c, _ in TABLE])
def test_what_a_change_rebuilds(built, tmp_path, change, rebuilt):
    w = tmp_path / "w"
    shutil.copytree(built, w, symlinks=True)
    cfg = _cfg(w, **(change(w) or {}))
    ctx = StageContext(cfg)
    run_stage(ctx, stage("scan"), PIPELINE)  # a scheduled run rescans first
    rows = {r.stage: r for r in status(StageContext(cfg), PIPELINE)}
    assert rows["scan"].state == "fresh"
    stale = {name for name, r in rows.items() if r.state != "fresh"}
    assert stale == rebuilt, {n: rows[n].reason for n in stale ^ rebuilt}


def test_a_library_minor_version_rebuilds_the_stages_it_computes(built, tmp_path, monkeypatch):
    """diffusers 0.42 -> 0.43 (simulated in the package metadata the keys read): the stages diffusers computes."""
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda n: "0.43.0" if n == "diffusers" else real(n))
    w = tmp_path / "w"
    shutil.copytree(built, w, symlinks=True)
    run_stage(StageContext(_cfg(w)), stage("scan"), PIPELINE)  # the copy's dataset lies elsewhere: rescan
    rows = {r.stage: r for r in status(StageContext(_cfg(w)), PIPELINE)}
    assert {n for n, r in rows.items() if r.state != "fresh"} == {"latents", "train", "validate"}, {
        n: r.reason for n, r in rows.items()
    }
    assert "diffusers" in rows["latents"].reason


def test_an_edited_caption_encodes_one_string_and_no_image(built, tmp_path):
    """The rows behind edit_caption's rebuild: latents copies every image, text encodes the one new caption and
    copies the rest, and the copied rows are the ones a full encode gives."""
    import numpy as np
    import zarr

    from tuneline.schemas.latents import LatentsManifest
    from tuneline.schemas.text import TextManifest

    w = tmp_path / "w"
    shutil.copytree(built, w, symlinks=True)
    edit_caption(w)
    ctx = StageContext(_cfg(w))
    paths = {name: run_stage(ctx, stage(name), PIPELINE)[0] for name in ("scan", "latents", "text")}
    lat = ctx.store.read(paths["latents"], LatentsManifest)
    txt = ctx.store.read(paths["text"], TextManifest)
    assert (lat.encoded, lat.reused) == (0, lat.count)
    assert (txt.encoded, txt.reused) == (1, txt.count - 1) and txt.count > 2

    def rows(path):
        group = zarr.open_group(str(path / "text.zarr"), mode="r")
        return {name: np.asarray(group[name][:]) for name in txt.fields}

    incremental = rows(paths["text"])
    forced, _ = run_stage(StageContext(_cfg(w), force=True), stage("text"), PIPELINE)
    assert ctx.store.read(forced, TextManifest).encoded == txt.count
    for name, full in rows(forced).items():
        np.testing.assert_allclose(incremental[name], full, rtol=0, atol=1e-5)
