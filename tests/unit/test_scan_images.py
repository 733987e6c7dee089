"""The scan's header probe and `load_rgb`: every mode, format and bad-input kind of issue 3."""

from __future__ import annotations

import hashlib
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from tuneline.schemas.scan import ImageRecord
from tuneline.stages.scan import images as images_mod
from tuneline.stages.scan.images import load_rgb, probe_file

BG = (0, 255, 0)


def png_chunks(width: int, height: int, depth: int, color_type: int, raw: bytes) -> bytes:
    """A PNG written by hand, for layouts PIL cannot save (16-bit RGB) or should refuse (bombs)."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", width, height, depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def probe(path: Path):
    st = path.stat()
    return probe_file(path, path.name, st.st_size, st.st_mtime_ns)


def record(p, background=BG) -> ImageRecord:
    facts = dict(bucket_width=8, bucket_height=8, crop=(0, 0, p.width, p.height), caption="")
    return ImageRecord(**p.record_facts(background), **facts)


def save(tmp_path: Path, name: str, img: Image.Image, **kw) -> Path:
    path = tmp_path / name
    img.save(path, **kw)
    return path


def half_red(size=(40, 20), mode="RGB") -> Image.Image:
    img = Image.new("RGB", size, (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, size[0] // 2, size[1]))
    return img.convert(mode)


@pytest.mark.parametrize(
    "name,kw",
    [("a.jpg", {}), ("a.png", {}), ("a.webp", {"lossless": True}), ("a.bmp", {}), ("a.tiff", {}), ("a.gif", {})],
)
def test_formats_probe_and_load(tmp_path, name, kw):
    path = save(tmp_path, name, half_red(), **kw)
    p = probe(path)
    assert not p.error and (p.width, p.height) == (40, 20)
    img = load_rgb(path, record(p))
    assert img.mode == "RGB" and img.size == (40, 20)
    assert img.getpixel((5, 10))[0] > 200 and img.getpixel((35, 10))[2] > 200


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
@pytest.mark.parametrize("fmt", ["jpg", "png", "webp"])
def test_exif_orientation_recorded_and_applied(tmp_path, orientation, fmt):
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = save(tmp_path, f"o.{fmt}", half_red(), exif=exif)
    p = probe(path)
    assert p.orientation == orientation
    assert (p.width, p.height) == ((20, 40) if orientation in (6, 8) else (40, 20))
    got = np.asarray(load_rgb(path, record(p)))
    with Image.open(path) as im:
        want = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
    assert got.shape == want.shape and np.array_equal(got, want)


def test_transparent_modes_composite_on_background(tmp_path):
    rgba = Image.new("RGBA", (16, 16), (255, 0, 0, 255))
    rgba.paste((0, 0, 0, 0), (0, 0, 8, 16))
    p_img = Image.new("P", (16, 16), 0)
    p_img.putpalette([255, 0, 0, 0, 0, 0] + [0] * 762)
    p_img.paste(1, (0, 0, 8, 16))
    cases = {
        "rgba.png": (rgba, {}),
        "la.png": (rgba.convert("LA"), {}),
        "p.png": (p_img, {"transparency": 1}),
        "p.gif": (p_img, {"transparency": 1}),
        "rgba.webp": (rgba, {"lossless": True}),
    }
    for name, (img, kw) in cases.items():
        path = save(tmp_path, name, img, **kw)
        p = probe(path)
        assert p.transparent and "over background" in p.conversion, name
        out = load_rgb(path, record(p))
        assert out.getpixel((2, 8)) == BG, name  # transparent half shows the configured background
        assert out.getpixel((12, 8)) != BG, name


def test_opaque_modes_are_converted_and_noted(tmp_path):
    cases = {
        "l.png": (Image.new("L", (8, 8), 100), "L->RGB", (100, 100, 100)),
        "cmyk.jpg": (Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "CMYK->RGB (no ICC profile)", None),
        "p.png": (Image.new("RGB", (8, 8), (10, 20, 30)).quantize(4), "P->RGB", (10, 20, 30)),
        "one.png": (Image.new("1", (8, 8), 1), "1->RGB", (255, 255, 255)),
    }
    for name, (img, note, pixel) in cases.items():
        path = save(tmp_path, name, img)
        p = probe(path)
        assert (p.conversion, p.transparent) == (note, False), name
        out = load_rgb(path, record(p))
        assert out.mode == "RGB" and (pixel is None or out.getpixel((3, 3)) == pixel), name
    cmyk = load_rgb(tmp_path / "cmyk.jpg", record(probe(tmp_path / "cmyk.jpg"))).getpixel((3, 3))
    assert cmyk[0] > 200 and cmyk[1] < 60 and cmyk[2] < 60  # cyan-free, full magenta+yellow = red


def test_sixteen_bit_is_scaled_not_clipped(tmp_path):
    gray = np.array([[0, 32896, 65535, 65535]] * 4, dtype=np.uint16)
    save(tmp_path, "g16.png", Image.fromarray(gray))
    p = probe(tmp_path / "g16.png")
    assert p.conversion.startswith("16-bit gray")
    assert [px[0] for px in np.asarray(load_rgb(tmp_path / "g16.png", record(p)))[0]] == [0, 128, 255, 255]
    rows = b"".join(b"\x00" + struct.pack(">HHH", 65535, 32896, 0) * 4 for _ in range(4))
    (tmp_path / "rgb16.png").write_bytes(png_chunks(4, 4, 16, 2, rows))
    p = probe(tmp_path / "rgb16.png")
    assert p.conversion == "16-bit RGB->8-bit RGB"
    assert load_rgb(tmp_path / "rgb16.png", record(p)).getpixel((1, 1)) == (255, 128, 0)


def test_animated_gif_uses_first_frame(tmp_path):
    frames = [Image.new("RGB", (8, 8), c).convert("P") for c in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])
    p = probe(tmp_path / "anim.gif")
    assert load_rgb(tmp_path / "anim.gif", record(p)).getpixel((4, 4)) == (255, 0, 0)


def bad_files(tmp_path: Path) -> dict[str, str]:
    """name -> expected rejection kind, one file per bad-input kind the probe must name."""
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    noise.save(tmp_path / "full.jpg")  # large enough that cutting it in half leaves the header whole
    half_red().save(tmp_path / "full.png")
    jpg, png = (tmp_path / "full.jpg").read_bytes(), (tmp_path / "full.png").read_bytes()
    files = {
        "empty.jpg": b"",
        "text.jpg": b"just some text, not an image\n" * 4,
        "cut.jpg": jpg[: len(jpg) // 2],
        "cut.png": png[: len(png) - 20],
        "header.png": png[:16] + b"\x00" * 64,
        "bomb.png": png_chunks(20000, 20000, 1, 0, b"\x00" * 64),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    Image.new("F", (8, 8), 0.5).save(tmp_path / "float.tiff")
    return {
        "empty.jpg": "empty-file",
        "text.jpg": "not-image",
        "cut.jpg": "truncated",
        "cut.png": "truncated",
        "header.png": "unreadable",
        "bomb.png": "bomb",
        "float.tiff": "mode",
    }


def test_each_bad_input_kind_is_named(tmp_path):
    for name, kind in bad_files(tmp_path).items():
        p = probe(tmp_path / name)
        assert p.kind == kind, (name, p.kind, p.error)
        assert p.error and not p.width
    gone = probe_file(tmp_path / "missing.png", "missing.png", 10, 0)
    assert gone.kind == "unreadable" and "cannot read" in gone.error


def test_streamed_large_files_probe_like_files_read_whole(tmp_path, monkeypatch):
    """Files above images.WHOLE stream through a buffer; every fact and rejection must match the in-memory read."""
    kinds = bad_files(tmp_path)
    exif = Image.Exif()
    exif[0x0112] = 6
    save(tmp_path, "o.jpg", half_red(), exif=exif)
    save(tmp_path, "a.tiff", half_red())
    names = [*kinds, "o.jpg", "a.tiff", "full.jpg"]
    whole = {n: probe(tmp_path / n) for n in names}
    monkeypatch.setattr(images_mod, "WHOLE", 0)
    monkeypatch.setattr(images_mod, "STREAM_BUFFER", 100)  # many buffer refills per file
    for n in names:
        assert probe(tmp_path / n) == whole[n], n
    assert whole["o.jpg"].orientation == 6 and (whole["o.jpg"].width, whole["o.jpg"].height) == (20, 40)
    assert whole["full.jpg"].sha256 == hashlib.sha256((tmp_path / "full.jpg").read_bytes()).hexdigest()
    assert [whole[n].kind for n in kinds] == list(kinds.values())


def test_load_rgb_refuses_a_file_changed_since_the_scan(tmp_path):
    path = save(tmp_path, "a.png", half_red())
    rec = record(probe(path))
    half_red((30, 30)).save(path)
    with pytest.raises(ValueError, match="a.png.*changed since the scan"):
        load_rgb(path, rec)
