"""Benchmark: the latents stage against the VAE encoder's own forward time (the compute limit) and a naive loop.

The model is the tiny family's pipeline with its VAE replaced by the SD VAE architecture (4 down blocks, two
ResNet layers each, 4 latent channels), narrowed to (32, 64, 128, 128) channels so a run fits in minutes on
2 CPU cores. The dataset is photo-like JPEGs and PNGs at 1.5-3x their bucket size (128 px shorter edge, three
aspect buckets), so decoding and resizing cost what they cost on real data. In one run, on the same images:
  limit  the stage's own encoder alone (stages/families/vae_encoder.py), batches of `batch_size` within a bucket,
         on tensors decoded and resized beforehand;
  stage  `run_stage` of the latents stage on a fresh workdir (scan done beforehand, untimed): VAE load, decode
         pool, encoding, checks, Zarr writes, index, manifest and publish;
  naive  decode one image, encode it alone, `torch.save` its latent to a `.pt` (SimpleTuner-style); timed on
         every third image and scaled, since it is the slow one.
Before the RESULT line, bench/video_cache.py's `clips_per_s_vs_encoder` line: the stage caching Wan clips against
Wan's VAE encoder alone.
The machine is shared and its load swings by 3x within a minute, so limit and stage alternate for ROUNDS
rounds (the stage on a fresh workdir each time) and the fastest of each counts.
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tuneline.schemas.config import parse_config  # noqa: E402
from tuneline.schemas.scan import ImageRecord  # noqa: E402
from tuneline.stages.common.jsonl import read_jsonl  # noqa: E402
from tuneline.stages.common.stage import StageContext, run_stage  # noqa: E402
from tuneline.stages.families import resolve as models  # noqa: E402
from tuneline.stages.families.registry import get_family  # noqa: E402
from tuneline.stages.latents.encode import to_pixels  # noqa: E402
from tuneline.stages.pipeline import PIPELINE, stage  # noqa: E402
from tuneline.stages.scan.images import load_rgb  # noqa: E402

N_IMAGES = 48
ROUNDS = 3
RESOLUTION = 128
BATCH = 8
VAE_CHANNELS = (32, 64, 128, 128)
GOAL = 1.25
NAIVE_EVERY = 3
ASPECTS = [(1, 1), (4, 3), (3, 4)]


def make_model(root: Path) -> Path:
    """A tiny pipeline folder whose VAE is the SD VAE architecture (random weights, deterministic)."""
    from diffusers import AutoencoderKL

    base = get_family("tiny").ensure_model(None, root / "models")
    folder = root / "bench-model"
    shutil.copytree(base, folder)
    shutil.rmtree(folder / "vae")
    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=VAE_CHANNELS,
        layers_per_block=2,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=RESOLUTION,
    )
    vae.save_pretrained(folder / "vae", safe_serialization=True)
    return folder


def photo(i: int, seed: int = 0) -> Image.Image:
    """Smooth content plus grain, 1.5-3x the bucket size, so compressed sizes and decode costs are realistic."""
    rng = np.random.default_rng([seed, i])
    aw, ah = ASPECTS[i % len(ASPECTS)]
    scale = rng.uniform(1.5, 3.0) * RESOLUTION / min(aw, ah)
    w, h = int(aw * scale), int(ah * scale)
    small = rng.integers(0, 256, size=(max(2, h // 24), max(2, w // 24), 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC), dtype=np.int16)
    grain = rng.integers(-6, 7, size=smooth.shape, dtype=np.int16)
    return Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8))


def make_images(folder: Path, names: range, seed: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in names:
        photo(i, seed).save(folder / (f"img{i:05d}.jpg" if i % 4 else f"img{i:05d}.png"), quality=90)
        (folder / f"img{i:05d}.txt").write_text(f"photo {i}")


def context(work: Path, data: Path, model: Path) -> StageContext:
    cfg = parse_config(
        {
            "dataset": {"path": str(data)},
            "model": {"family": "tiny", "path": str(model)},
            "buckets": {"resolution": RESOLUTION},
            "latents": {"batch_size": BATCH},
        },
        workdir=str(work),
    )
    return StageContext(cfg)


def records(ctx: StageContext) -> list[ImageRecord]:
    return [ImageRecord.model_validate(r) for r in read_jsonl(ctx.store.latest("scan") / "images.jsonl")]


def time_stage(ctx: StageContext) -> float:
    t = time.perf_counter()
    _, built = run_stage(ctx, stage("latents"), PIPELINE)
    assert built
    return time.perf_counter() - t


def time_limit(ctx: StageContext, data: Path) -> float:
    """The stage's own encoder's forward alone, same batches as the stage, pixels decoded beforehand."""
    by_bucket = defaultdict(list)
    for r in sorted(records(ctx), key=lambda r: r.path):
        by_bucket[(r.bucket_width, r.bucket_height)].append(to_pixels(load_rgb(data / r.path, r), r))
    return time_encoder_alone(ctx, list(by_bucket.values()), BATCH)


def time_encoder_alone(ctx: StageContext, buckets: list[list[torch.Tensor]], batch: int) -> float:
    """Seconds the stage's own encoder (the family's load_vae_encoder) takes over each bucket's pixel tensors,
    `batch` at a time (bench/video_cache.py times clips with it too)."""
    vae = models.family(ctx.cfg).load_vae_encoder(models.model_dir(ctx), torch.float32, torch.device("cpu"))
    t = time.perf_counter()
    with torch.no_grad():
        for pixels in buckets:
            for i in range(0, len(pixels), batch):
                vae.encode(torch.stack(pixels[i : i + batch])).latent_dist.mean.sum()
    return time.perf_counter() - t


def time_naive(ctx: StageContext, data: Path, out: Path) -> float:
    """Seconds for all the images, measured on every NAIVE_EVERY-th one, with diffusers' AutoencoderKL as a
    script of its own would load it."""
    out.mkdir(parents=True)
    recs = records(ctx)[::NAIVE_EVERY]
    vae = load_vae(ctx)
    t = time.perf_counter()
    with torch.no_grad():
        for i, r in enumerate(recs):
            x = to_pixels(load_rgb(data / r.path, r), r)[None]
            torch.save(vae.encode(x).latent_dist.sample()[0].half(), out / f"{i}.pt")
    return (time.perf_counter() - t) * len(records(ctx)) / len(recs)


def load_vae(ctx: StageContext):
    return models.family(ctx.cfg).load_vae(models.model_dir(ctx), torch.float32, torch.device("cpu"))


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="tuneline-bench-cache-"))
    try:
        model = make_model(tmp)
        data = tmp / "data"
        make_images(data, range(N_IMAGES))
        limits, stages, ctx = alternate(
            lambda r: context(tmp / f"work{r}", data, model), lambda c: time_limit(c, data), ROUNDS
        )
        t_naive = time_naive(ctx, data, tmp / "naive")
        import video_cache  # bench/video_cache.py: the same figure for Wan's clips, printed before the RESULT

        print(video_cache.figure_line(*video_cache.measure()))
        report(min(stages), min(limits), t_naive)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def alternate(make_context, time_limit_of, rounds: int) -> tuple[list[float], list[float], StageContext]:
    """The encoder alone and the stage, alternating for `rounds` rounds, each on a fresh workdir (its scan done
    first, untimed); prints both series; (encoder seconds, stage seconds, the last round's context)."""
    limits, stages = [], []
    for r in range(rounds):
        ctx = make_context(r)
        run_stage(ctx, stage("scan"), PIPELINE)
        limits.append(time_limit_of(ctx))
        stages.append(time_stage(ctx))
    print(
        f"rounds: encoder alone {', '.join(f'{t:.1f}' for t in limits)} s; "
        f"stage {', '.join(f'{t:.1f}' for t in stages)} s"
    )
    return limits, stages, ctx


def report(t_stage: float, t_limit: float, t_naive: float) -> None:
    print(
        f"{N_IMAGES} images, {RESOLUTION} px buckets, SD VAE architecture {VAE_CHANNELS}, batch {BATCH}, "
        f"{torch.get_num_threads()} torch threads, CPU"
    )
    print(f"encoder forward alone (limit): {t_limit:.1f} s (fastest round)")
    print(f"latents stage:                 {t_stage:.1f} s (fastest round)")
    print(f"naive loop:                    {t_naive:.1f} s (every {NAIVE_EVERY}rd image, scaled)")
    print(f"stage vs naive loop: {t_naive / t_stage:.2f}x faster (ratio naive/stage)")
    ratio = t_stage / t_limit
    print(f"RESULT cache_vs_encoder_limit {ratio:.3f} goal <= {GOAL} {'PASS' if ratio <= GOAL else 'FAIL'}")


if __name__ == "__main__":
    main()
