"""Bad-input corpus: scan -> latents on a dataset of broken and unusual files. Every bad file is handled with a
named reason (rejected with one, or accepted with the conversion/orientation/crop recorded, or reported as a
duplicate), every good file is accepted and cached, and both stages publish."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from tests.reliability.faultlib import ROOT, cli_args

GOOD = 12
MIN_EDGE = 32
RNG = np.random.default_rng(0)


def _noise(w: int, h: int) -> Image.Image:
    return Image.fromarray(RNG.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def _jpeg(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (a decompression bomb's calling card), with no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IEND", b"")
    )


def build_corpus(root: Path, outside: Path) -> None:
    root.mkdir(parents=True)
    outside.mkdir(parents=True)
    for i in range(GOOD):
        name = f"good_{i:02d}." + ("png" if i % 2 else "jpg")
        im = _noise(*((64, 64), (96, 64), (64, 96))[i % 3])
        im.save(root / name)
        (root / name).with_suffix(".txt").write_text(f"a picture of thing {i}", encoding="utf-8")
    (root / "truncated.jpg").write_bytes(_jpeg(_noise(64, 64))[:900])
    png = io.BytesIO()
    _noise(64, 64).save(png, "PNG")
    body = bytearray(png.getvalue())
    idat = body.index(b"IDAT")
    body[idat + 40 : idat + 240] = bytes(200)  # header and end marker intact, pixel data garbage
    (root / "corrupt_body.png").write_bytes(bytes(body))
    (root / "empty.png").write_bytes(b"")
    (root / "notes.png").write_text("these are my notes, not a picture\n" * 20, encoding="utf-8")
    (root / "bomb.png").write_bytes(_png_claiming(100_000, 100_000))
    Image.fromarray(RNG.integers(0, 256, (64, 64, 4), dtype=np.uint8), "CMYK").save(root / "cmyk.jpg")
    Image.fromarray(RNG.integers(0, 65535, (64, 64), dtype=np.uint16)).save(root / "deep16.png")
    pal = Image.fromarray(RNG.integers(0, 4, (64, 64), dtype=np.uint8), "P")
    pal.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0])
    pal.save(root / "palette.png", transparency=3)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view: stored 96x64, shown 64x96
    (root / "rotated.jpg").write_bytes(_jpeg(_noise(96, 64), exif=exif.tobytes()))
    _noise(20, 20).save(root / "small.png")
    _noise(40, 800).save(root / "tall.png")  # 1:20
    _noise(64, 64).save(root / "badcap.png")
    (root / "badcap.txt").write_bytes(b"a caption with \xff\xfe invalid bytes")
    _noise(64, 64).save(outside / "secret.png")
    (root / "escape.png").symlink_to(outside / "secret.png")
    dup = _noise(64, 64)
    dup.save(root / "dup_a.png")
    (root / "dup_b.png").write_bytes((root / "dup_a.png").read_bytes())


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory):
    """scan + latents on the corpus, in-process through the stage runner (no Prefect needed for the cores)."""
    from tuneline.schemas.config import parse_config
    from tuneline.stages.common.stage import StageContext, run_stage
    from tuneline.stages.pipeline import PIPELINE, stage

    tmp = tmp_path_factory.mktemp("corpus")
    build_corpus(tmp / "data", tmp / "outside")
    cfg = yaml.safe_load(
        subprocess.run(cli_args("config", "example"), capture_output=True, text=True, cwd=ROOT, check=True).stdout
    )
    cfg["workdir"] = str(tmp / "work")
    cfg["dataset"].update(path=str(tmp / "data"), demo=False)
    cfg["buckets"]["min_edge"] = MIN_EDGE
    cfg["latents"]["block_rows"] = 4
    ctx = StageContext(parse_config(cfg, "<corpus>"))
    scan_dir, _ = run_stage(ctx, stage("scan"), PIPELINE)
    latents_dir, _ = run_stage(ctx, stage("latents"), PIPELINE)
    return {
        "images": {r["path"]: r for r in read(scan_dir / "images.jsonl")},
        "rejected": {r["path"]: r for r in read(scan_dir / "rejected.jsonl")},
        "latent_rejected": {r["path"]: r for r in read(latents_dir / "rejected.jsonl")},
        "cached": {r["path"] for r in read(latents_dir / "index.jsonl")},
        "manifest": json.loads((scan_dir / "manifest.json").read_text(encoding="utf-8")),
        "aspects": (cfg["buckets"]["min_aspect"], cfg["buckets"]["max_aspect"]),
    }


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _reason(run: dict, name: str) -> str:
    """The named reason a file was refused, by the scan or at caching time ('' if it was not)."""
    r = run["rejected"].get(name) or run["latent_rejected"].get(name)
    return f"{r.get('kind', '')}: {r['reason']}" if r else ""


def test_every_good_image_is_accepted_and_cached(corpus_run):
    good = {f"good_{i:02d}." + ("png" if i % 2 else "jpg") for i in range(GOOD)}
    assert good <= set(corpus_run["images"]), sorted(good - set(corpus_run["images"]))
    assert good <= corpus_run["cached"], sorted(good - corpus_run["cached"])
    assert all(corpus_run["images"][g]["caption"].startswith("a picture of") for g in good)


@pytest.mark.parametrize(
    "name,words",
    [
        ("truncated.jpg", ("truncat", "cut short", "decode", "incomplete")),
        ("corrupt_body.png", ("decode", "corrupt", "crc", "broken")),
        ("empty.png", ("empty", "0 bytes", "zero")),
        ("notes.png", ("not an image", "not a", "cannot identify", "unidentified")),
        ("bomb.png", ("bomb",)),
        ("small.png", (str(MIN_EDGE), "min_edge", "small")),
        ("badcap.png", ("UTF-8", "utf-8")),
        ("escape.png", ("outside",)),
    ],
)
def test_broken_file_is_rejected_with_a_named_reason(corpus_run, name, words):
    reason = _reason(corpus_run, name)
    assert reason, f"{name} was not rejected (accepted: {name in corpus_run['images']})"
    assert name not in corpus_run["cached"], f"{name} was cached despite: {reason}"
    assert any(w.lower() in reason.lower() for w in words), f"{name}: reason does not say why: {reason}"


def test_symlink_target_outside_the_root_is_never_read(corpus_run):
    assert not any("secret" in p for p in (*corpus_run["images"], *corpus_run["cached"]))


@pytest.mark.parametrize("name", ["cmyk.jpg", "deep16.png", "palette.png"])
def test_unusual_mode_is_converted_with_the_conversion_recorded(corpus_run, name):
    """docs/reliability.md promises these are accepted: converted, recorded, and cached."""
    rec = corpus_run["images"].get(name)
    assert rec is not None, f"{name} was not accepted: {_reason(corpus_run, name)}"
    assert rec["conversion"], f"{name} (mode {rec['mode']}) accepted without a recorded conversion"
    assert name in corpus_run["cached"], f"{name} was not cached: {_reason(corpus_run, name)}"
    if name == "palette.png":
        assert rec["background"] is not None, "transparent pixels composited on an unrecorded background"


def test_exif_rotation_is_applied_and_recorded(corpus_run):
    rec = corpus_run["images"]["rotated.jpg"]
    assert (rec["orientation"], rec["width"], rec["height"]) == (6, 64, 96)
    assert rec["bucket_height"] > rec["bucket_width"], "bucketed as stored, not as shown"
    assert "rotated.jpg" in corpus_run["cached"]


def test_extreme_aspect_is_cropped_into_the_limits(corpus_run):
    rec = corpus_run["images"].get("tall.png")
    assert rec is not None, f"the 1:20 image was not accepted: {_reason(corpus_run, 'tall.png')}"
    lo, hi = corpus_run["aspects"]
    left, top, right, bottom = rec["crop"]
    assert lo * 0.9 <= (right - left) / (bottom - top) <= hi * 1.1, f"1:20 image kept at crop {rec['crop']}"
    assert lo * 0.9 <= rec["bucket_width"] / rec["bucket_height"] <= hi * 1.1
    assert "tall.png" in corpus_run["cached"]


def test_duplicates_are_reported(corpus_run):
    groups = [sorted(g) for g in corpus_run["manifest"]["duplicates"]]
    assert ["dup_a.png", "dup_b.png"] in groups, groups


def test_every_file_is_accounted_for(corpus_run):
    """No file silently dropped: each image file is accepted or rejected with a reason."""
    for name in (
        "cmyk.jpg",
        "deep16.png",
        "palette.png",
        "rotated.jpg",
        "tall.png",
        "dup_a.png",
        "dup_b.png",
        "truncated.jpg",
        "corrupt_body.png",
        "empty.png",
        "notes.png",
        "bomb.png",
        "small.png",
        "badcap.png",
        "escape.png",
    ):
        assert name in corpus_run["images"] or _reason(corpus_run, name), f"{name} vanished without a reason"
