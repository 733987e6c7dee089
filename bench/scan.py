"""Benchmark: the scan stage's cold run against a loop that fully decodes the same images.

Generates ~2,000 images of varied sizes, formats and modes (photo-like: smooth content plus grain, so
compressed sizes are realistic; kept in the temp folder for later runs), then in one run times (a)
`run_stage` of the scan on a fresh workdir (listing, hashing every byte, header reads, captions, bucketing,
publishing) and (b) opening and decoding every file to RGB with the scan's thread count, alternating over a
few rounds.
Prints images/s for both and the ratio last.
"""
from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.config import parse_config  # noqa: E402
from stages.common.stage import StageContext, run_stage  # noqa: E402
from stages.scan import STAGE  # noqa: E402
from stages.scan.core import WORKERS as SCAN_WORKERS  # noqa: E402

N_IMAGES = 2000
GENERATOR_VERSION = "2"
DATA = Path(tempfile.gettempdir()) / f"tuneline-bench-scan-v{GENERATOR_VERSION}"
GOAL = 10.0
ROUNDS = 3
# (extension, PIL mode, content) in the proportions of a mixed training folder: mostly JPEG photos; PNGs
# split between photos and illustrations/renders (flat regions: what PNG is usually chosen for); a few
# WebP; BMP, uncompressed TIFF and GIF as the rare, cheap-to-decode, expensive-to-hash outliers.
KINDS = ([("jpg", "RGB", "photo")] * 11 + [("png", "RGB", "photo")] * 3 + [("png", "RGB", "flat")] * 3
         + [("png", "RGBA", "flat"), ("png", "L", "photo"), ("webp", "RGB", "photo"), ("webp", "RGB", "photo"),
            ("bmp", "RGB", "photo"), ("tiff", "RGB", "photo"), ("gif", "P", "flat")])

# Fast encoder settings: generation should not dominate the benchmark's wall time.
SAVE = {"jpg": {"quality": 90}, "webp": {"quality": 90, "method": 0}, "png": {"compress_level": 1}}


def _image(i: int, content: str) -> Image.Image:
    """Photo: smooth colour fields plus sensor-like grain. Flat: the same fields posterized, no grain."""
    rng = np.random.default_rng(i)
    w, h = (int(x) for x in rng.integers(320, 1280, size=2))
    small = rng.integers(0, 256, size=(max(2, h // 64), max(2, w // 64), 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC), dtype=np.int16)
    if content == "flat":
        return Image.fromarray((smooth // 48 * 48).astype(np.uint8))
    grain = rng.integers(-6, 7, size=smooth.shape, dtype=np.int16)
    return Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8))


def _write(args: tuple[Path, int]) -> None:
    root, i = args
    ext, mode, content = KINDS[i % len(KINDS)]
    img = _image(i, content)
    img = img.quantize(64, method=Image.Quantize.FASTOCTREE) if mode == "P" else img.convert(mode)
    img.save(root / f"img_{i:05d}.{ext}", **SAVE.get(ext, {}))
    (root / f"img_{i:05d}.txt").write_text(f"a generated image number {i}", encoding="utf-8")


def generate(root: Path) -> None:
    """Write the images once and keep them: encoding dominates otherwise, and only the scan is measured cold."""
    if (root / ".complete").is_file():
        return
    tmp = root.with_name(f"{root.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with ProcessPoolExecutor() as pool:
        list(pool.map(_write, [(tmp, i) for i in range(N_IMAGES)], chunksize=32))
    (tmp / ".complete").write_text(GENERATOR_VERSION, encoding="utf-8")
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)


def time_scan(root: Path, workdir: Path) -> tuple[float, int]:
    cfg = parse_config({"workdir": str(workdir), "dataset": {"path": str(root)},
                        "buckets": {"resolution": 512}}, "<bench>")
    t = time.perf_counter()
    path, built = run_stage(StageContext(cfg), STAGE, [STAGE])
    elapsed = time.perf_counter() - t
    assert built
    accepted = sum(1 for _ in open(path / "images.jsonl", encoding="utf-8"))
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


def main() -> None:
    logging.disable(logging.WARNING)
    t = time.perf_counter()
    generate(DATA)
    print(f"{N_IMAGES} images in {DATA} ready in {time.perf_counter() - t:.1f}s", flush=True)
    time_decode(DATA)  # warm the page cache for both contenders alike
    scans, decodes = [], []
    # Rounds alternate the contenders so load from other processes hits both; the fastest round of each
    # is kept, since noise on a shared machine only ever adds time.
    for r in range(ROUNDS):
        work = Path(tempfile.mkdtemp(prefix="tuneline-bench-scan-work-"))
        try:
            scans.append(time_scan(DATA, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        decodes.append(time_decode(DATA))
        print(f"round {r + 1}: scan {scans[-1][0]:.2f}s, decode {decodes[-1][0]:.2f}s", flush=True)
    (scan_s, accepted), (decode_s, decoded) = min(scans), min(decodes)
    assert accepted == decoded == N_IMAGES, (accepted, decoded)
    scan_rate, decode_rate = accepted / scan_s, decoded / decode_s
    print(f"scan stage (cold, hashing every byte): {scan_s:.2f}s, {scan_rate:.0f} images/s")
    print(f"full decode, {SCAN_WORKERS} threads like the scan: {decode_s:.2f}s, {decode_rate:.0f} images/s")
    speedup = scan_rate / decode_rate
    print(f"RESULT scan_speedup {speedup:.2f} goal >= {GOAL:g} {'PASS' if speedup >= GOAL else 'FAIL'}")


if __name__ == "__main__":
    main()
