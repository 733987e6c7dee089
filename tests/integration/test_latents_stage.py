"""The latents stage on the tiny model: layout and facts, decode rejects, staleness, incremental, errors."""

from __future__ import annotations

import io
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from PIL import Image

from tuneline.schemas.config import parse_config
from tuneline.schemas.latents import LatentsManifest
from tuneline.schemas.scan import ImageRecord
from tuneline.stages.common.report import Reporter
from tuneline.stages.common.sizing import latent_shape
from tuneline.stages.common.stage import StageContext, run_stage, status
from tuneline.stages.families import resolve as models
from tuneline.stages.families.registry import get_family
from tuneline.stages.latents import store
from tuneline.stages.latents.encode import LatentShapeError, to_pixels
from tuneline.stages.latents.reader import LatentReader
from tuneline.stages.pipeline import PIPELINE, stage
from tuneline.stages.scan.images import load_rgb

SIZES = [(64, 64), (96, 64), (64, 96), (80, 58)]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """The tiny model, built once per session; every workdir links its `models` folder here."""
    return tiny_model_dir(tmp_path_factory.getbasetemp())


def tiny_model_dir(base: Path) -> Path:
    folder = base / "latents-models"
    get_family("tiny").ensure_model(None, folder)  # idempotent: modules sharing `base` build it once
    return folder


def write_images(folder: Path, names: range, seed: int = 0) -> None:
    """Colored, slightly noisy images in four sizes (three buckets at 64 px), with captions."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in names:
        rng = np.random.default_rng([seed, i])
        w, h = SIZES[i % len(SIZES)]
        color = rng.integers(0, 255, 3)
        arr = np.clip(color + rng.integers(-20, 20, (h, w, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(arr).save(folder / f"img{i:03d}.{'png' if i % 2 else 'jpg'}")
        (folder / f"img{i:03d}.txt").write_text(f"image {i}")


def corrupt_png() -> bytes:
    """Header and end marker intact, pixel stream broken: the scan accepts it, decoding fails."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(9).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    at = data.find(b"IDAT") + 20
    data[at : at + 64] = bytes(b ^ 0x5A for b in data[at : at + 64])
    return bytes(data)


class Recorder(Reporter):
    def __init__(self):
        self.progress_calls: list[tuple[str, float]] = []

    def progress(self, key, fraction, description=""):
        self.progress_calls.append((key, fraction))


def context(work: Path, data: Path, models_dir: Path, force: bool = False, **latents) -> StageContext:
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "models").exists():
        os.symlink(models_dir, work / "models")
    cfg = parse_config(
        {
            "dataset": {"path": str(data)},
            "model": {"family": "tiny", "path": None},
            "latents": {"block_rows": 4, "batch_size": 3, **latents},
        },
        workdir=str(work),
    )
    return StageContext(cfg, reporter=Recorder(), force=force)


def build(ctx: StageContext) -> tuple[Path, LatentsManifest]:
    run_stage(ctx, stage("scan"), PIPELINE)
    path, _ = run_stage(ctx, stage("latents"), PIPELINE)
    return path, ctx.store.read(path, LatentsManifest)


def rows_by_path(path: Path, manifest: LatentsManifest, name: str = "mean") -> dict[str, np.ndarray]:
    # zarr's own reader, as a user opening the cache would
    arrays = {b.array: zarr.open_array(str(path / store.STORE / b.array / name), mode="r")[:] for b in manifest.buckets}
    return {r["path"]: arrays[r["bucket"]][r["row"]] for r in map(json.loads, (path / store.INDEX).open())}


@pytest.fixture(scope="module")
def flipped(tiny_models, tmp_path_factory):
    """One build with the flip variant and one undecodable image, shared by the read-only checks."""
    tmp = tmp_path_factory.mktemp("latents-flip")
    write_images(tmp / "data", range(14))
    (tmp / "data" / "broken.png").write_bytes(corrupt_png())
    ctx = context(tmp / "work", tmp / "data", tiny_models, flip=True)
    path, manifest = build(ctx)
    return ctx, path, manifest


def test_manifest_records_identity_layout_and_counts(flipped):
    ctx, path, m = flipped
    assert (m.count, m.rejected, m.encoded, m.reused, m.resumed) == (14, 1, 14, 0, 0)
    assert m.vae_identity == models.identity(ctx, "vae") and m.dtype == "float16" and m.vae_dtype == "float32"
    assert m.flip and m.block_rows == 4 and m.upstream["scan"] == ctx.store.latest("scan").name
    assert m.size_policy["resolution"] == 64 and m.size_policy["alignment"] == 8 and m.size_policy["crop"] == "center"
    scan = {r["path"]: r for r in map(json.loads, (ctx.store.latest("scan") / "images.jsonl").open())}
    want = Counter(
        store.bucket_key(r["bucket_width"], r["bucket_height"]) for p, r in scan.items() if p != "broken.png"
    )
    assert len(want) == 4 and {b.array: b.count for b in m.buckets} == want
    assert all(b.shape == latent_shape(b.width, b.height, 4, 8) for b in m.buckets)
    rejected = [json.loads(line) for line in (path / "rejected.jsonl").open()]
    assert [(r["path"], r["kind"]) for r in rejected] == [("broken.png", "decode")]
    assert "cannot decode at caching time" in rejected[0]["reason"]
    index = [json.loads(line) for line in (path / store.INDEX).open()]
    for bucket in {r["bucket"] for r in index}:  # rows of a bucket are its images sorted by path
        rows = sorted((r["row"], r["path"]) for r in index if r["bucket"] == bucket)
        assert [p for _, p in rows] == sorted(p for _, p in rows)
    fractions = [f for key, f in ctx.reporter.progress_calls if key == "latents-progress"]
    assert fractions[-1] == 1.0 and fractions == sorted(fractions)


def test_stored_rows_are_the_vae_distribution_of_the_recorded_crop(flipped):
    ctx, path, m = flipped
    scan_dir = ctx.store.latest("scan")
    recs = {r["path"]: r for r in map(json.loads, (scan_dir / "images.jsonl").open())}
    fam = models.family(ctx.cfg)
    vae = fam.load_vae(models.model_dir(ctx), torch.float32, torch.device("cpu"))
    rec = ImageRecord.model_validate(recs["img003.png"])  # 80x58: cropped to its bucket's aspect
    x = to_pixels(load_rgb(Path(ctx.cfg.dataset.path) / rec.path, rec), rec)[None]
    with torch.no_grad():
        plain, flip = vae.encode(x).latent_dist, vae.encode(x.flip(-1)).latent_dist
    for name, want in (("mean", plain.mean), ("std", plain.std), ("flip_mean", flip.mean), ("flip_std", flip.std)):
        got = rows_by_path(path, m, name)[rec.path]
        np.testing.assert_allclose(got.astype(np.float32), want[0].numpy(), rtol=2e-3, atol=2e-3)


def test_reader_serves_the_stage_output(flipped):
    _, path, m = flipped
    reader = LatentReader(path, m)
    for bucket, rows in reader.plan(batch_size=2, world_size=1, seed=0, epoch=0):
        batch = reader.batch(bucket, rows, flip=[True, False])
        x = reader.sample(batch, torch.Generator().manual_seed(0))
        assert x.shape == (2, *reader.shapes[bucket]) and torch.isfinite(x).all()


def test_staleness_follows_size_policy_dtype_and_model_not_speed_knobs(tiny_models, tmp_path):
    write_images(tmp_path / "data", range(6))
    ctx = context(tmp_path / "work", tmp_path / "data", tiny_models)
    build(ctx)

    def latents_state(**changes) -> tuple[str, str]:
        data = ctx.cfg.dump()
        for dotted, value in changes.items():
            section, key = dotted.split("__")
            data[section][key] = value
        other = StageContext(parse_config(data, workdir=str(ctx.workdir)))
        row = {r.stage: r for r in status(other, [stage("scan"), stage("latents")])}["latents"]
        return row.state, row.reason

    assert latents_state()[0] == "fresh"
    assert latents_state(latents__batch_size=5, latents__workers=1)[0] == "fresh"
    state, reason = latents_state(latents__dtype="float32")
    assert state == "stale" and "latents.dtype" in reason
    state, reason = latents_state(model__dtype="bfloat16")
    assert state == "stale" and "model.dtype" in reason
    assert latents_state(buckets__max_aspect=2.0)[0] == "stale"  # size policy: rebucketing images
    # Recorded as a fact; it acts through the scan's records (buckets, crops), so it is not keyed twice.
    assert ctx.store.read(ctx.store.latest("latents"), LatentsManifest).size_policy["max_aspect"] != 2.0


def test_incremental_encodes_only_new_or_changed_images(tiny_models, tmp_path):
    data = tmp_path / "data"
    write_images(data, range(16))
    ctx = context(tmp_path / "work", data, tiny_models)
    old_path, old = build(ctx)
    old_rows = rows_by_path(old_path, old)
    write_images(data, range(16, 18))  # 2 new
    write_images(data, range(5, 6), seed=1)  # 1 changed
    (data / "img003.png").unlink()  # 1 removed
    path, m = build(ctx)
    assert (m.count, m.encoded, m.reused) == (17, 3, 14)
    rows = rows_by_path(path, m)
    assert "img003.png" not in rows and {"img016.jpg", "img017.png"} <= set(rows)
    for p in set(rows) & set(old_rows) - {"img005.png"}:
        np.testing.assert_array_equal(rows[p], old_rows[p])  # copied, bit for bit
    assert not np.array_equal(rows["img005.png"], old_rows["img005.png"])
    assert ctx.store.read(old_path, LatentsManifest).count == 16  # the previous version is untouched
    shutil.rmtree(path)  # with only the older version left, --force still copies nothing from it
    full_path, full = build(context(tmp_path / "work", data, tiny_models, force=True))
    assert full_path == path and (full.encoded, full.reused) == (17, 0)
    for p, row in rows_by_path(full_path, full).items():
        np.testing.assert_allclose(row.astype(np.float32), rows[p].astype(np.float32), atol=2e-3, rtol=2e-3)


class BrokenVAE(torch.nn.Module):
    """Wraps the real VAE; corrupts the output for one image (by its pixel mean) in a chosen way."""

    def __init__(self, vae, how: str):
        super().__init__()
        self.vae, self.how, self.dtype = vae, how, vae.dtype

    def encode(self, x):
        out = self.vae.encode(x)
        dist = out.latent_dist
        if self.how == "shape":
            dist.mean = dist.mean[..., :-1]
        else:
            dist.mean[-1, 0, 0, 0] = float("nan")
        return out


@pytest.mark.parametrize(
    "how, message",
    [
        ("shape", r"latent shape mismatch for image img\d+\.\w+: expected \(4, \d+, \d+\), got \(4, \d+, \d+\)"),
        ("nan", r"NaN/Inf latent mean for image img\d+\.\w+"),
    ],
)
def test_bad_vae_output_fails_naming_the_image_and_publishes_nothing(tiny_models, tmp_path, monkeypatch, how, message):
    write_images(tmp_path / "data", range(5))
    ctx = context(tmp_path / "work", tmp_path / "data", tiny_models)
    fam = models.family(ctx.cfg)
    real = fam.load_vae_encoder
    monkeypatch.setattr(fam, "load_vae_encoder", lambda *a: BrokenVAE(real(*a), how))
    with pytest.raises(LatentShapeError, match=message):
        build(ctx)
    assert ctx.store.latest("latents") is None
    assert "LatentShapeError" in ctx.store.last_failure("latents")["error"]
    shutil.rmtree(tmp_path / "work" / "artifacts")


def test_refuses_to_run_inside_a_distributed_launch(tiny_models, tmp_path, monkeypatch):
    write_images(tmp_path / "data", range(2))
    ctx = context(tmp_path / "work", tmp_path / "data", tiny_models)
    run_stage(ctx, stage("scan"), PIPELINE)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="runs in one process, before training"):
        run_stage(ctx, stage("latents"), PIPELINE)
