"""Benchmark: the latents stage caching video clips (Wan) against Wan's VAE encoder alone, in clips per second.

The model is Wan's tiny flavor with its VAE widened to AutoencoderKLWan's released layout at a sixth of its width
(base 16 instead of 96, the same levels and temporal downsampling), so a run fits in minutes on 2 CPU cores. The
dataset is H.264 MP4 clips of moving textured content at 1.5x their bucket size and 24 fps, cut by the scan to
17 frames at 16 fps (5 latent frames). In one run, on the same clips:
  encoder  the stage's own clip encoder alone (the family's load_vae_encoder), batches of `batch_size` within a
           bucket, on frames decoded, resampled and resized beforehand;
  stage    `run_stage` of the latents stage on a fresh workdir (scan done beforehand, untimed): VAE load, PyAV
           decoding at the bucket's rate, encoding, checks, Zarr writes, index, manifest and publish.
Encoder and stage alternate for ROUNDS rounds (the shared machine's load swings) and the fastest of each counts.
`bench/cache.py` prints this benchmark's figure line too (`clips_per_s_vs_encoder`).
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cache import alternate, time_encoder_alone  # noqa: E402  bench/cache.py: the latents stage timed on a fresh workdir

from tuneline.schemas.config import parse_config  # noqa: E402
from tuneline.schemas.scan import ImageRecord  # noqa: E402
from tuneline.stages.common.jsonl import read_jsonl  # noqa: E402
from tuneline.stages.common.stage import StageContext  # noqa: E402
from tuneline.stages.families.registry import get_family  # noqa: E402
from tuneline.stages.latents.encode import prepare  # noqa: E402

N_CLIPS = 8
ROUNDS = 2
RESOLUTION = 64
FRAMES = 17
SOURCE_FPS = 24
BATCH = 4
VAE_BASE = 16
GOAL = 0.5  # clips/s of the stage over the encoder's: PyAV decoding and resampling cost on top of encoding


def make_model(root: Path) -> Path:
    """Wan's tiny pipeline folder with AutoencoderKLWan at a sixth of the released width (random weights)."""
    from diffusers import AutoencoderKLWan

    folder = get_family("wan").ensure_model(None, root / "models")
    torch.manual_seed(0)  # the tiny VAE's weights replaced in place: model.path names this folder
    AutoencoderKLWan(base_dim=VAE_BASE, z_dim=16).save_pretrained(folder / "vae", safe_serialization=True)
    return folder


def make_clips(folder: Path) -> None:
    """MP4 clips 1.5x the bucket size: a smooth random texture drifting by two pixels a frame, plus grain."""
    import av
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    side = RESOLUTION * 3 // 2
    for i in range(N_CLIPS):
        rng = np.random.default_rng(i)
        small = rng.integers(0, 256, size=(side // 8, side // 4, 3), dtype=np.uint8)
        texture = np.asarray(Image.fromarray(small).resize((side * 2, side), Image.Resampling.BICUBIC), np.int16)
        with av.open(str(folder / f"clip{i:03d}.mp4"), "w") as out:
            stream = out.add_stream("libx264", rate=SOURCE_FPS)
            stream.width, stream.height, stream.pix_fmt = side, side, "yuv420p"
            for t in range(FRAMES * SOURCE_FPS // 16 + 2):
                grain = rng.integers(-6, 7, size=(side, side, 3), dtype=np.int16)
                pixels = np.clip(texture[:, 2 * t : 2 * t + side] + grain, 0, 255).astype(np.uint8)
                out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
            out.mux(stream.encode())
        (folder / f"clip{i:03d}.txt").write_text(f"a texture drifting left, clip {i}")


def context(work: Path, data: Path, model: Path) -> StageContext:
    cfg = parse_config(
        {
            "dataset": {"path": str(data)},
            "model": {"family": "wan", "path": str(model)},
            "buckets": {"resolution": RESOLUTION, "frames": [FRAMES]},
            "latents": {"batch_size": BATCH},
        },
        workdir=str(work),
    )
    return StageContext(cfg)


def time_encoder(ctx: StageContext, data: Path) -> float:
    """The stage's own clip encoder alone, the stage's batches, frames decoded and sized beforehand."""
    recs = [ImageRecord.model_validate(r) for r in read_jsonl(ctx.store.latest("scan") / "images.jsonl")]
    assert len(recs) == N_CLIPS and all(r.frames == FRAMES for r in recs), "the scan did not cut every clip"
    by_bucket = defaultdict(list)
    for r in sorted(recs, key=lambda r: r.path):
        by_bucket[(r.bucket_width, r.bucket_height, r.frames)].append(prepare(data, r))
    return time_encoder_alone(ctx, list(by_bucket.values()), BATCH)


def measure() -> tuple[float, float]:
    """(fastest stage seconds, fastest encoder-alone seconds) for N_CLIPS clips."""
    tmp = Path(tempfile.mkdtemp(prefix="tuneline-bench-video-"))
    try:
        model, data = make_model(tmp), tmp / "data"
        make_clips(data)
        encoder, stages, _ = alternate(
            lambda r: context(tmp / f"work{r}", data, model), lambda c: time_encoder(c, data), ROUNDS
        )
        return min(stages), min(encoder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def figure_line(t_stage: float, t_encoder: float) -> str:
    """clips/s of the stage and of the encoder alone, and their ratio (the RESULT value)."""
    return (
        f"clips_per_s_vs_encoder {t_encoder / t_stage:.3f} (stage {N_CLIPS / t_stage:.2f} clips/s, encoder alone "
        f"{N_CLIPS / t_encoder:.2f} clips/s; {N_CLIPS} clips of {FRAMES} frames at {RESOLUTION} px, Wan VAE base "
        f"{VAE_BASE}, batch {BATCH}, {torch.get_num_threads()} torch threads, CPU)"
    )


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    t_stage, t_encoder = measure()
    print(figure_line(t_stage, t_encoder))
    ratio = t_encoder / t_stage
    print(f"RESULT clips_per_s_vs_encoder {ratio:.3f} goal >= {GOAL} {'PASS' if ratio >= GOAL else 'FAIL'}")


if __name__ == "__main__":
    main()
