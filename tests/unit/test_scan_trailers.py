"""Photos with data after their end marker (phones' Motion Photos, PNGs with blocks after IEND) are accepted
and their trailer recorded; a cut file is still refused as truncated."""

from __future__ import annotations

import os

import numpy as np
from PIL import Image

from tuneline.stages.scan import images as images_mod
from tuneline.stages.scan.images import load_rgb, probe_file

MP4 = b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom" + os.urandom(64 << 10)  # a video trailer, no EOI in it


def probe(path):
    st = path.stat()
    return probe_file(path, path.name, st.st_size, st.st_mtime_ns)


def noise(size=(64, 48)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(1).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def test_motion_photo_jpeg_with_mp4_trailer_is_accepted(tmp_path):
    noise().save(tmp_path / "plain.jpg", quality=90, exif=Image.Exif())
    jpg = (tmp_path / "plain.jpg").read_bytes()
    trailer = MP4.replace(b"\xff\xd9", b"\xff\x00")
    (tmp_path / "motion.jpg").write_bytes(jpg + trailer)
    p = probe(tmp_path / "motion.jpg")
    assert not p.error, p.error
    assert (p.width, p.height, p.trailer) == (64, 48, len(trailer))
    assert probe(tmp_path / "plain.jpg").trailer == 0
    assert np.array_equal(np.asarray(load_rgb(tmp_path / "motion.jpg")), np.asarray(load_rgb(tmp_path / "plain.jpg")))


def test_png_with_more_than_4k_after_iend_is_accepted(tmp_path):
    noise().save(tmp_path / "a.png")
    extra = b"editor data " * 1000  # > images.TAIL
    (tmp_path / "b.png").write_bytes((tmp_path / "a.png").read_bytes() + extra)
    p = probe(tmp_path / "b.png")
    assert not p.error, p.error
    assert p.trailer == len(extra) > images_mod.TAIL


def test_cut_files_are_still_truncated(tmp_path):
    noise().save(tmp_path / "a.jpg")
    noise().save(tmp_path / "a.png")
    for name in ("a.jpg", "a.png"):
        data = (tmp_path / name).read_bytes()
        (tmp_path / f"cut-{name}").write_bytes(data[: len(data) * 2 // 3])
        p = probe(tmp_path / f"cut-{name}")
        assert p.kind == "truncated", (name, p.kind, p.error)


def test_trailer_reaches_the_scan_record(tmp_path):
    from tuneline.schemas.config import load_config
    from tuneline.stages.common.sizing import size_policy
    from tuneline.stages.scan.captions import Captions
    from tuneline.stages.scan.core import alignment
    from tuneline.stages.scan.listing import walk
    from tuneline.stages.scan.records import make_record

    data = tmp_path / "data"
    data.mkdir()
    noise((256, 256)).save(tmp_path / "x.jpg")
    (data / "m.jpg").write_bytes((tmp_path / "x.jpg").read_bytes() + MP4.replace(b"\xff\xd9", b"\xff\x00"))
    cfg = load_config(None, str(tmp_path / "work"))
    cfg = cfg.model_copy(update={"dataset": cfg.dataset.model_copy(update={"path": str(data), "demo": False})})
    listing = walk(data, cfg.dataset)
    p = probe(data / "m.jpg")
    rec = make_record(p, Captions(listing, cfg.dataset), size_policy(cfg.buckets, alignment(cfg)), cfg)
    assert getattr(rec, "trailer", None) == len(MP4), rec
