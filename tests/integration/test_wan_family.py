"""Wan 2.1's tiny flavor on a folder of clips and images, through the stage functions in one process: the scan's
clip records (4k+1 frames at the bucket's rate, a time range each), the latents of every clip cached and checked
as (C, T*h, w), and a LoRA trained on them by the real training loop."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from tests.clips import write_clip, write_gif
from tests.trainer import steps, trainer_for
from tuneline.schemas.config import parse_config
from tuneline.schemas.scan import ImageRecord
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.pipeline import PIPELINE, stage
from tuneline.stages.scan.video import load_clip

CAPTIONS = {"left.mp4": "a square moves left", "right.webm": "a square moves right", "still.png": "a square"}


def _dataset(root):
    root.mkdir(parents=True)
    write_clip(root / "left.mp4", frames=24, fps=16, size=(48, 32))  # 1.5 s: one 9-frame clip at 8 fps
    write_clip(root / "right.webm", frames=40, fps=32, size=(48, 32))  # 1.25 s at 32 fps: frames 0, 4, 8, ...
    write_gif(root / "spin.gif", frames=8, ms=100, size=(48, 32))  # 0.8 s: 6 frames at 8 fps, a 5-frame clip
    Image.new("RGB", (48, 32), (200, 40, 40)).save(root / "still.png")
    for name, caption in CAPTIONS.items():
        (root / name).with_suffix(".txt").write_text(caption, encoding="utf-8")


def _config(tmp, family="wan", **buckets):
    return parse_config(
        {
            "dataset": {"path": str(tmp / "data")},
            "model": {"family": family, "path": None, "device": "cpu"},
            "buckets": {"resolution": 32, "fps": 8, "frames": [5, 9], **buckets},
            "text": {"max_length": 16},
            "train": {"steps": 2, "batch_size": 1, "processes": 1, "mode": "lora", "lora_rank": 4},
        },
        workdir=str(tmp / "work"),
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wan")
    _dataset(tmp / "data")
    ctx = StageContext(_config(tmp))
    dirs = {name: run_stage(ctx, stage(name), PIPELINE)[0] for name in ("scan", "latents", "text")}
    return tmp, ctx, dirs


def test_scan_records_clips_with_frames_rate_and_time_range(built):
    _, _, dirs = built
    recs = {r["path"]: r for r in read_jsonl(dirs["scan"] / "images.jsonl")}
    assert set(recs) == {"left.mp4", "right.webm", "spin.gif", "still.png"}
    left, right, gif = recs["left.mp4"], recs["right.webm"], recs["spin.gif"]
    assert (left["frames"], left["fps"], left["start"], left["end"]) == (9, 8.0, 0.0, 1.125)
    assert (left["source_frames"], left["source_fps"], left["width"], left["height"]) == (24, 16.0, 48, 32)
    assert (right["frames"], right["source_frames"], right["source_fps"]) == (9, 40, 32.0)
    assert (gif["frames"], gif["source_frames"], gif["source_fps"]) == (5, 8, 10.0)
    assert recs["still.png"]["frames"] == 1 and recs["still.png"]["start"] is None
    rows = json.loads((dirs["scan"] / "manifest.json").read_text())["buckets"]
    assert sorted((r["frames"], r["count"]) for r in rows) == [(1, 1), (5, 1), (9, 2)]


def test_clip_frames_decode_at_the_bucket_rate(built):
    tmp, _, dirs = built
    recs = {r["path"]: ImageRecord.model_validate(r) for r in read_jsonl(dirs["scan"] / "images.jsonl")}
    frames = load_clip(tmp / "data" / "right.webm", recs["right.webm"])  # source frame i is gray 6 * i
    levels = [float(np.asarray(f).mean()) for f in frames]
    assert len(frames) == 9 and frames[0].size == (48, 32)
    assert np.allclose(levels, [6 * 4 * i for i in range(9)], atol=4), levels


def test_latents_hold_each_clip_as_its_latent_frames(built):
    _, _, dirs = built
    manifest = json.loads((dirs["latents"] / "manifest.json").read_text())
    shapes = {b["frames"] if "frames" in b else 1: tuple(b["shape"]) for b in manifest["buckets"]}
    # 32x48 px -> 4x6 latents; 9 frames -> 3 latent frames, 5 -> 2, an image 1: stacked along the height
    assert shapes == {9: (16, 12, 6), 5: (16, 8, 6), 1: (16, 4, 6)}
    assert manifest["encoded"] == 4


def test_a_lora_trains_on_clips_and_images(built):
    tmp, ctx, _ = built
    trainer = trainer_for(ctx.cfg, ctx)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    steps(trainer, 2)
    assert before and all("lora" in n for n in before)  # only the adapter trains
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not p.detach().equal(before[n])]
    assert changed and all(np.isfinite(trainer.losses))


def test_an_image_family_rejects_video_files_and_keeps_its_version(tmp_path):
    _dataset(tmp_path / "data")
    ctx = StageContext(_config(tmp_path, family="tiny"))
    scan_dir = run_stage(ctx, stage("scan"), PIPELINE)[0]
    recs = {r["path"]: r for r in read_jsonl(scan_dir / "images.jsonl")}
    rejected = {r["path"]: r for r in read_jsonl(scan_dir / "rejected.jsonl")}
    assert set(recs) == {"spin.gif", "still.png"} and recs["spin.gif"]["frames"] is None  # a GIF's first frame
    assert {rejected[p]["kind"] for p in ("left.mp4", "right.webm")} == {"video"}
    assert "model.family wan" in rejected["left.mp4"]["reason"]
    # buckets.fps / frames / clip shape no image family's records: changing them leaves its scan as it was
    again = StageContext(_config(tmp_path, family="tiny", fps=24, frames=[17], clip="every"))
    assert run_stage(again, stage("scan"), PIPELINE)[0] == scan_dir


def test_clip_every_cuts_a_file_into_consecutive_clips(tmp_path):
    _dataset(tmp_path / "data")
    ctx = StageContext(_config(tmp_path, frames=[5], clip="every"))
    scan_dir = run_stage(ctx, stage("scan"), PIPELINE)[0]
    clips = [ImageRecord.model_validate(r) for r in read_jsonl(scan_dir / "images.jsonl")]
    left = [(r.ref, r.frames, r.start, r.end) for r in clips if r.path == "left.mp4"]
    # 1.5 s at 8 fps: two whole 5-frame clips of 0.625 s, each a record named by its time range
    assert left == [("left.mp4#t=0,0.625", 5, 0.0, 0.625), ("left.mp4#t=0.625,1.25", 5, 0.625, 1.25)]


def test_validation_renders_moving_clips_shown_inline(built, tmp_path):
    """The validate stage's renderer on the tiny flavor: each prompt a clip (validate.frames) written as MP4 and
    animated WebP, the grid a contact sheet of frames, and the Prefect artifact's tile an animated WebP."""
    import base64
    import io

    import av

    from tuneline.flows.results import grid_markdown
    from tuneline.stages.families import resolve as models
    from tuneline.stages.validate.core import load_renderer, render_prompts

    _, ctx, _ = built
    cfg = ctx.cfg.model_copy(
        update={"validate_": ctx.cfg.validate_.model_copy(update={"frames": 9, "steps": 2, "resolution": 32})}
    )
    run = StageContext(cfg)
    rendered = render_prompts(run, load_renderer(run, models.model_dir(run)), tmp_path)
    assert [(r.file, r.clip, r.frames) for r in rendered] == [("000-seed0.webp", "000-seed0.mp4", 9)]
    with Image.open(tmp_path / rendered[0].file) as im:
        assert (im.n_frames, im.size) == (9, (32, 32))
        frames = [np.asarray(im.seek(i) or im.convert("RGB"), dtype=np.int16) for i in range(9)]
    assert max(np.abs(f - frames[0]).max() for f in frames[1:]) > 0, "a clip whose frames never change"
    with av.open(str(tmp_path / rendered[0].clip)) as f:
        decoded = [x.to_ndarray(format="rgb24") for x in f.decode(video=0)]
    assert len(decoded) == 9 and decoded[0].shape == (32, 32, 3)
    with Image.open(tmp_path / "grid.png") as sheet:  # one row of 8 frames, evenly spaced
        assert sheet.size == (8 * 32, 32)
    manifest = {"grid": "grid.png", "images": [r.model_dump() for r in rendered]}
    tile = grid_markdown(cfg, tmp_path, manifest).split("data:image/webp;base64,")[1].split(")")[0]
    with Image.open(io.BytesIO(base64.b64decode(tile))) as inline:
        assert inline.n_frames > 1


def test_validate_frames_follow_the_frame_rule(tmp_path):
    with pytest.raises(ValueError, match=r"validate.frames 8 breaks family 'wan'.*use 5"):
        parse_config({"model": {"family": "wan", "path": None}, "validate": {"frames": 8}}, workdir=str(tmp_path / "w"))


def test_scan_to_validate_shows_the_lora_clips(built):
    """train and validate after the module's caches: the validate stage renders the trained LoRA (loaded into the
    stock WanPipeline) as clips, and its manifest names each clip's animated WebP and MP4."""
    from tuneline.schemas.validate import ValidateManifest

    tmp, ctx, _ = built
    v = ctx.cfg.validate_.model_copy(update={"frames": 5, "steps": 2, "learning_check": False})
    run = StageContext(ctx.cfg.model_copy(update={"validate_": v}))
    paths = {name: run_stage(run, stage(name), PIPELINE)[0] for name in ("train", "validate")}
    val = run.store.read(paths["validate"], ValidateManifest)
    assert [(i.frames, i.clip) for i in val.images] == [(5, "000-seed0.mp4")]
    with Image.open(paths["validate"] / val.images[0].file) as im:
        assert im.n_frames == 5
    assert (paths["validate"] / val.grid).is_file()
