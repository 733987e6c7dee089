"""The caching figures of bench/gpu.py: images per second of the latents stage as users run it against the stage's
own encoder alone on pixels decoded beforehand (cache_vs_encoder, cache_images_per_s)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from gpu_setup import Bench, free, result


def encoder_images_per_s(b: Bench, ctx) -> float:
    """The stage's own encoder alone on pixels decoded beforehand, in the stage's batches."""
    import torch

    from tuneline.schemas.scan import ImageRecord
    from tuneline.stages.common.jsonl import read_jsonl
    from tuneline.stages.families import resolve as models
    from tuneline.stages.latents.encode import to_pixels
    from tuneline.stages.scan.images import load_rgb

    cfg, dev = ctx.cfg, torch.device(b.device)
    recs = [ImageRecord.model_validate(r) for r in read_jsonl(ctx.store.latest("scan") / "images.jsonl")]
    dtype = models.dtype(cfg, dev)
    pixels = torch.stack([to_pixels(load_rgb(cfg.resolve(cfg.dataset.path) / r.path, r), r) for r in recs])
    vae = models.family(cfg).load_vae_encoder(models.model_dir(ctx), dtype, dev)
    batch = cfg.latents.batch_size
    with torch.no_grad():
        for _ in range(2):  # the first round warms up
            b.sync()
            start = time.perf_counter()
            for i in range(0, len(pixels), batch):
                vae.encode(pixels[i : i + batch].to(dev, dtype)).latent_dist.mean.sum()
            b.sync()
    return len(pixels) / (time.perf_counter() - start)


def stage_seconds(b: Bench, cfg, images: int, suffix: str):
    """Seconds of the latents stage as users run it (after scan) on `images` images in a workdir of its own, made
    afresh: a cache an earlier figure published there (cache_vs_encoder and cache_images_per_s both cache SDXL)
    would be reused, not timed."""
    from tuneline.stages.common.stage import StageContext, run_stage
    from tuneline.stages.pipeline import PIPELINE, stage

    data = {"path": str(b.images(cfg.model.family, images))}
    workdir = f"{cfg.workdir}-{suffix}"
    shutil.rmtree(Path(workdir), ignore_errors=True)
    ctx = StageContext(cfg.model_copy(update={"workdir": workdir, "dataset": cfg.dataset.model_copy(update=data)}))
    run_stage(ctx, stage("scan"), PIPELINE)
    b.sync()
    start = time.perf_counter()
    _, built = run_stage(ctx, stage("latents"), PIPELINE)
    b.sync()
    seconds = time.perf_counter() - start
    assert built, f"the latents stage in {workdir} reused a published cache: nothing was timed"
    return seconds, ctx


def stage_images_per_s(b: Bench, cfg) -> tuple[float, object]:
    """Images per second of the latents stage in a user's run of thousands: the extra images over the extra
    seconds of a run on twice the images (after a warm-up run), so the stage's fixed costs (loading the VAE,
    starting its decode workers, publishing), which a run of 64 images still weighs at a quarter of its time on
    an H200, fall out as they do over thousands. Each size's best of two runs (one on --tiny): the difference
    doubles a run's noise, and on an H200 one 128-image run 0.6 s slower than the next read 0.76 where the next
    pair read 0.98. Both sizes' own rates are printed beside it."""
    n = b.cache_images
    stage_seconds(b, cfg, n, "warm")
    once = twice = float("inf")
    for _ in range(min(b.rounds, 2)):
        seconds, ctx = stage_seconds(b, cfg, n, "once")
        once = min(once, seconds)
        twice = min(twice, stage_seconds(b, cfg, 2 * n, "twice")[0])
    print(f"latents stage: {n} images {n / once:.2f} images/s, {2 * n} images {2 * n / twice:.2f}", flush=True)
    # Where the two runs' noise is a good part of the extra images' time (a loaded CPU under --tiny), the
    # difference means little: the larger run's own rate then.
    return (n / (twice - once) if twice - once > 0.25 * once else 2 * n / twice), ctx


def cache_rates(b: Bench, families: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """(stage, encoder) images per second of each family's latents cache."""
    rates = {}
    for family in families:
        cfg = b.config(f"cache-{family}", family, images=b.cache_images, latents={"batch_size": 4})
        ours, ctx = stage_images_per_s(b, cfg)
        rates[family] = ours, encoder_images_per_s(b, ctx)
        print(
            f"cache {family} at {b.resolution(family)}: stage {ours:.2f} images/s, encoder {rates[family][1]:.2f} "
            f"images/s, ratio {ours / rates[family][1]:.3f}",
            flush=True,
        )
        free(b)
    return rates


def cache_vs_encoder(b: Bench) -> None:
    ours, pure = cache_rates(b, ("sdxl",) if b.tiny else ("sd15", "sdxl"))["sdxl"]
    result("cache_vs_encoder", ours / pure, ">=", 0.8)


def cache_images_per_s(b: Bench) -> None:
    """The SDXL and Flux VAEs at 1024²: the worse stage / encoder ratio, SDXL's images per second beside it."""
    rates = cache_rates(b, ("sdxl", "flux"))
    worst = min(ours / pure for ours, pure in rates.values())
    ours, pure = rates["sdxl"]
    result("cache_images_per_s", worst, ">=", 0.8, sdxl_images_per_s=ours, sdxl_encoder_images_per_s=pure)
