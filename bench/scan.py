"""Benchmark: the scan stage's cold run against a loop that fully decodes the same images.

Generates 1,000 images sized like a real training folder (kept in the temp folder for later runs, about
1.6 GB, about two minutes on two cores):
- photos, 8 in 21 (JPEG at quality 93 with a camera EXIF block): half are 12 MP phone frames (4032x3024, a
  third of those portrait shots stored sideways with EXIF orientation 6, as phones store them), half 2-12 MP
  camera frames and exports (4:3, 3:2, 16:9 or 1:1, either way up);
- renders and illustrations, 8 in 21, 1024-2048 px on the long side: PNG (photo-like, flat, RGBA), one JPEG,
  one WebP, one uncompressed TIFF;
- small web images, 5 in 21, 480-1024 px on the long side: JPEG, WebP, grayscale PNG, BMP, GIF.
Content is photo-like (smooth colour fields plus sensor grain, so compressed sizes are realistic) or flat
(posterized, what PNG is chosen for). Mean 4.5 MP, median 2.2 MP; 299 images have at most 1 MP.

Timed, alternating over ROUNDS rounds, best of each: (a) `run_stage` of the scan on a fresh workdir (listing,
SHA-256 of every byte, header reads, captions, bucketing, publishing) and (b) opening and decoding every file
to RGB with the scan's thread count. First on the at-most-1-MP subset (a folder of hard links to the same
files), where decoding is cheap and the scan's advantage smallest; then on the whole set, whose ratio is the
RESULT (last line).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tuneline.schemas.config import parse_config  # noqa: E402
from tuneline.stages.common.stage import StageContext, run_stage  # noqa: E402
from tuneline.stages.scan import STAGE  # noqa: E402
from tuneline.stages.scan.core import WORKERS as SCAN_WORKERS  # noqa: E402

N_IMAGES = 1000
GENERATOR_VERSION = "3"
DATA = Path(tempfile.gettempdir()) / f"tuneline-bench-scan-v{GENERATOR_VERSION}"
GOAL = 10.0
ROUNDS = 3
SMALL_PIXELS = 1024 * 1024  # the subset whose ratio is printed beside the RESULT: images of at most 1 MP
# (extension, PIL mode, content, size class) in the proportions of a mixed training folder: mostly JPEG
# photos; PNGs split between photo-like renders and illustrations (flat regions: what PNG is usually chosen
# for); a few WebP; BMP, uncompressed TIFF and GIF as the rare, cheap-to-decode, expensive-to-hash outliers.
KINDS = (
    [("jpg", "RGB", "photo", "photo")] * 8
    + [("jpg", "RGB", "photo", "render"), ("jpg", "RGB", "photo", "small")]
    + [("png", "RGB", "photo", "render")] * 2
    + [("png", "RGB", "flat", "render")] * 2
    + [
        ("png", "RGBA", "flat", "render"),
        ("webp", "RGB", "photo", "render"),
        ("tiff", "RGB", "photo", "render"),
        ("webp", "RGB", "photo", "small"),
        ("png", "L", "photo", "small"),
        ("bmp", "RGB", "photo", "small"),
        ("gif", "P", "flat", "small"),
    ]
)
# Sizes of a real training folder rather than thumbnails: photos are what phones and cameras write (half are
# 12 MP phone frames, 4032x3024, a third of those portrait shots stored sideways with EXIF orientation 6 as
# phones store them; the other half 2-12 MP camera frames and exports), renders 1024-2048 px on the long
# side, and "small" web images 480-1024 px (at most 1 MP).
ASPECTS = ((4, 3), (3, 2), (16, 9), (1, 1))

# Fast encoder settings: generation should not dominate the benchmark's wall time. JPEG at the quality
# cameras and phones save at (92-95).
SAVE = {"jpg": {"quality": 93}, "webp": {"quality": 90, "method": 0}, "png": {"compress_level": 1}}


def _size(i: int, size_class: str) -> tuple[int, int, int]:
    """(width, height, EXIF orientation) of image i: a pure function of i, so subsets need no file read."""
    rng = np.random.default_rng([i, 1])
    if size_class == "photo" and rng.random() < 0.5:
        return (4032, 3024, 6) if rng.random() < 1 / 3 else (4032, 3024, 1)
    aw, ah = ASPECTS[int(rng.integers(len(ASPECTS)))]
    if size_class == "photo":
        area = rng.uniform(2e6, 12e6)
        long_side = int((area * max(aw, ah) / min(aw, ah)) ** 0.5)
    else:
        long_side = int(rng.integers(1024, 2049) if size_class == "render" else rng.integers(480, 1025))
    short = long_side * min(aw, ah) // max(aw, ah)
    return (long_side, short, 1) if rng.random() < 0.6 else (short, long_side, 1)


def _image(i: int, w: int, h: int, content: str) -> Image.Image:
    """Photo: smooth colour fields plus sensor-like grain. Flat: the same fields posterized, no grain."""
    rng = np.random.default_rng(i)
    small = rng.integers(0, 256, size=(max(2, h // 64), max(2, w // 64), 3), dtype=np.uint8)
    smooth = Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)
    if content == "flat":
        return Image.fromarray(np.asarray(smooth) // 48 * 48)
    pixels = np.asarray(smooth, dtype=np.int16) + rng.integers(-6, 7, size=(h, w, 3), dtype=np.int8)
    return Image.fromarray(np.clip(pixels, 0, 255, out=pixels).astype(np.uint8))


def _write(args: tuple[Path, int]) -> None:
    root, i = args
    ext, mode, content, size_class = KINDS[i % len(KINDS)]
    w, h, orientation = _size(i, size_class)
    img = _image(i, w, h, content)
    img = img.quantize(64, method=Image.Quantize.FASTOCTREE) if mode == "P" else img.convert(mode)
    extra = {}
    if ext == "jpg":  # a camera's EXIF block (make, model, orientation), as every phone photo carries
        exif = Image.Exif()
        exif.update({0x010F: "Tuneline", 0x0110: "Bench Phone", 0x0112: orientation})
        extra["exif"] = exif.tobytes()
    img.save(root / f"img_{i:05d}.{ext}", **SAVE.get(ext, {}), **extra)
    (root / f"img_{i:05d}.txt").write_text(f"a generated image number {i}", encoding="utf-8")


def _pixels(i: int) -> int:
    w, h, _ = _size(i, KINDS[i % len(KINDS)][3])
    return w * h


def small_indices() -> list[int]:
    return [i for i in range(N_IMAGES) if _pixels(i) <= SMALL_PIXELS]


def generate(root: Path) -> tuple[Path, Path]:
    """Write the images once and keep them: encoding dominates otherwise, and only the scan is measured cold.

    Returns (every image, the at-most-1-MP subset): the subset folder holds hard links to the same files.
    """
    if not (root / ".complete").is_file():
        tmp = root.with_name(f"{root.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "all").mkdir(parents=True)
        (tmp / "small").mkdir()
        # Largest first, so the pool's last chunks are short.
        order = sorted(range(N_IMAGES), key=_pixels, reverse=True)
        with ProcessPoolExecutor() as pool:
            list(pool.map(_write, [(tmp / "all", i) for i in order], chunksize=4))
        for i in small_indices():
            for p in (tmp / "all").glob(f"img_{i:05d}.*"):
                os.link(p, tmp / "small" / p.name)
        (tmp / ".complete").write_text(GENERATOR_VERSION, encoding="utf-8")
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
    return root / "all", root / "small"


def time_scan(root: Path) -> tuple[float, int]:
    work = Path(tempfile.mkdtemp(prefix="tuneline-bench-scan-work-"))
    try:
        cfg = parse_config(
            {"workdir": str(work), "dataset": {"path": str(root)}, "buckets": {"resolution": 512}}, "<bench>"
        )
        t = time.perf_counter()
        path, built = run_stage(StageContext(cfg), STAGE, [STAGE])
        elapsed = time.perf_counter() - t
        assert built
        accepted = sum(1 for _ in open(path / "images.jsonl", encoding="utf-8"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return elapsed, accepted


def _decode(p: Path) -> None:
    with Image.open(p) as im:
        im.convert("RGB").load()


def time_decode(root: Path) -> tuple[float, int]:
    """The reference uses as many threads as the scan (PIL releases the GIL while decoding), so the ratio compares
    the work done, not the parallelism."""
    files = sorted(p for p in root.iterdir() if p.suffix != ".txt" and not p.name.startswith("."))
    t = time.perf_counter()
    with ThreadPoolExecutor(SCAN_WORKERS) as pool:
        list(pool.map(_decode, files, chunksize=16))
    return time.perf_counter() - t, len(files)


def measure(root: Path, label: str, expected: int) -> float:
    """Best-of-ROUNDS scan and decode of one folder, alternating; prints both rates, returns the ratio."""
    time_decode(root)  # warm the page cache for both contenders alike
    scans, decodes = [], []
    # Rounds alternate the contenders so load from other processes hits both; the fastest round of each
    # is kept, since noise on a shared machine only ever adds time.
    for r in range(ROUNDS):
        scans.append(time_scan(root))
        decodes.append(time_decode(root))
        print(f"{label} round {r + 1}: scan {scans[-1][0]:.2f}s, decode {decodes[-1][0]:.2f}s", flush=True)
    (scan_s, accepted), (decode_s, decoded) = min(scans), min(decodes)
    assert accepted == decoded == expected, (accepted, decoded, expected)
    scan_rate, decode_rate = accepted / scan_s, decoded / decode_s
    print(
        f"{label}: scan stage (cold, hashing every byte) {scan_s:.2f}s, {scan_rate:.0f} images/s; full decode "
        f"with {SCAN_WORKERS} threads like the scan {decode_s:.2f}s, {decode_rate:.0f} images/s; "
        f"ratio {scan_rate / decode_rate:.2f}",
        flush=True,
    )
    return scan_rate / decode_rate


def main() -> None:
    logging.disable(logging.WARNING)
    t = time.perf_counter()
    every, small = generate(DATA)
    n_small = len(small_indices())
    size = sum(p.stat().st_size for p in every.iterdir())
    print(
        f"{N_IMAGES} images ({size / 1e9:.2f} GB, {n_small} of at most 1 MP) in {DATA} ready in "
        f"{time.perf_counter() - t:.1f}s",
        flush=True,
    )
    small_ratio = measure(small, f"{n_small} images of at most 1 MP", n_small)
    speedup = measure(every, f"all {N_IMAGES} images", N_IMAGES)
    print(f"scan_speedup on the images of at most 1 MP only: {small_ratio:.2f}")
    print(f"RESULT scan_speedup {speedup:.2f} goal >= {GOAL:g} {'PASS' if speedup >= GOAL else 'FAIL'}")


if __name__ == "__main__":
    main()
