"""Benchmark: caching after adding 1 % new images, against caching everything, in one run on the same data.

Model and images as in bench/cache.py (SD VAE architecture, photo-like files at 1.5-3x their 128 px buckets).
  full         the latents stage on N images (scan done beforehand, untimed);
  incremental  N/100 new images are added, the scan reruns (untimed), the latents stage reruns: it copies the
               N unchanged rows from the previous version block-wise and encodes only the new images;
  overhead     one image is removed and the stage reruns: nothing to encode, so this is what a rerun costs
               besides encoding (VAE load, verifying the previous version, copying, index, publish).
The goal: incremental <= 3 % of full plus FIXED_OVERHEAD_S, a fixed cost stated here and checked against the
measured overhead line.
"""
from __future__ import annotations

import logging
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cache import context, make_images, make_model, time_stage  # noqa: E402
from schemas.latents import LatentsManifest  # noqa: E402
from stages.common.stage import run_stage  # noqa: E402
from stages.pipeline import PIPELINE, stage  # noqa: E402

N_IMAGES = 200
GOAL = 0.03
FIXED_OVERHEAD_S = 2.0  # loading a full-size SD VAE (335 MB) and hashing it take about this here


def rerun(ctx) -> tuple[float, LatentsManifest]:
    run_stage(ctx, stage("scan"), PIPELINE)
    seconds = time_stage(ctx)
    return seconds, ctx.store.read(ctx.store.latest("latents"), LatentsManifest)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="tuneline-bench-incremental-"))
    try:
        model = make_model(tmp)
        data = tmp / "data"
        make_images(data, range(N_IMAGES))
        ctx = context(tmp / "work", data, model)
        t_full, full = rerun(ctx)
        new = max(1, N_IMAGES // 100)
        make_images(data, range(N_IMAGES, N_IMAGES + new), seed=1)
        t_incr, incr = rerun(ctx)
        assert (incr.encoded, incr.reused) == (new, full.count), (incr.encoded, incr.reused)
        for p in data.glob("img00001.*"):
            p.unlink()
        t_over, over = rerun(ctx)
        assert over.encoded == 0
        report(t_full, t_incr, t_over, new)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report(t_full: float, t_incr: float, t_over: float, new: int) -> None:
    target = GOAL + FIXED_OVERHEAD_S / t_full
    ratio = t_incr / t_full
    print(f"full cache of {N_IMAGES} images: {t_full:.1f} s")
    print(f"+{new} new images ({100 * new / N_IMAGES:.0f} %): {t_incr:.1f} s")
    print(f"rerun with nothing to encode (measured fixed overhead): {t_over:.1f} s; stated allowance "
          f"{FIXED_OVERHEAD_S:.1f} s")
    print(f"goal: incremental <= {GOAL} x full + {FIXED_OVERHEAD_S:.1f} s, i.e. ratio <= {GOAL} + "
          f"{FIXED_OVERHEAD_S:.1f} / {t_full:.1f} = {target:.3f}")
    print(f"RESULT incremental_vs_full {ratio:.3f} goal <= {target:.3f} {'PASS' if ratio <= target else 'FAIL'}")


if __name__ == "__main__":
    main()
