"""The demo's learning check: do samples for class c land nearest to class c's mean cached latent?

Distances are Euclidean over whole latents in the denoiser's (scaled) space, against the class means of the
cached latents of the same shape as the samples (the square bucket). Whole latents, not channel means: a tiny VAE
need not separate colors in its channel means, but does in the spatial pattern. The same samples, decoded, feed
the pixel-space check (colors.py).
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from tuneline.schemas.demo import DEMO_COLORS, DEMO_SHAPES
from tuneline.schemas.latents import LatentsManifest
from tuneline.schemas.scan import ImageRecord
from tuneline.stages.caption import upstream_captions
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.families import resolve as models
from tuneline.stages.families.base import latent_affine, scale_latents
from tuneline.stages.latents import store
from tuneline.stages.render.renderer import Renderer, Sample, render_size_for

CHECK_SEED = 1000  # check samples use seeds CHECK_SEED + i, apart from the validation prompts' own seeds


def class_means(
    latents_dir: Path,
    manifest: LatentsManifest,
    scan_dir: Path,
    shape: tuple[int, int, int],
    captions: dict[str, str] | None = None,
    classes: tuple[str, ...] = DEMO_COLORS,
) -> dict[str, np.ndarray]:
    """Per class (a word of the caption: a demo color, or the video demo's direction), the mean scaled latent of
    the cached images whose latent has `shape` (C, H, W); captions from `captions` (by image ref: the caption
    stage's, when on) or the scan's records."""
    if captions is None:
        records = (ImageRecord.model_validate(r) for r in read_jsonl(scan_dir / "images.jsonl"))
        captions = {r.ref: r.caption for r in records}  # by ref, as the cache's index names a clip's time range
    buckets = {b.array: b for b in manifest.buckets if tuple(b.shape) == tuple(shape)}
    if not buckets:
        raise ValueError(
            f"no cached bucket has latents of shape {shape} to compare samples with; render the "
            f"learning check at one of {[b.array for b in manifest.buckets]}"
        )
    blocks = {}
    for key, b in buckets.items():
        mean, _ = store.read_block(store.open_bucket(latents_dir, b.width, b.height, frames=b.frames), 0, b.count)
        blocks[key] = scale_latents(torch.from_numpy(mean.astype(np.float32)), *latent_affine(manifest)).numpy()
    found: dict[str, list[np.ndarray]] = defaultdict(list)
    for row in read_jsonl(latents_dir / store.INDEX):
        words = captions.get(row["path"], "").split()
        for name in classes:
            if row["bucket"] in blocks and name in words:
                found[name].append(blocks[row["bucket"]][row["row"]])
    return {c: np.mean(v, axis=0) for c, v in found.items()}


def square_class_means(ctx, upstream: dict, check: str) -> tuple[int, int, dict[str, np.ndarray]] | None:
    """(width, height, per-color mean latent) for a learning check rendered at the square render size, or None
    (logged as `check` skipped) when the cache cannot give the means."""
    lat = upstream["latents"]
    width, height = render_size_for(ctx.cfg, aspect=1.0)
    shape = (lat.latent_channels, height // lat.vae_factor, width // lat.vae_factor)
    scan_dir = ctx.store.version_dir("scan", lat.upstream["scan"])
    try:
        means = class_means(models.artifact_dir(ctx, lat), lat, scan_dir, shape, upstream_captions(ctx, upstream))
    except ValueError as err:
        ctx.log.warning("%s skipped: %s", check, err)
        return None
    return width, height, means


def check_samples(cfg) -> tuple[list[str], list[Sample]]:
    """The check's (prompted color, sample) pairs: every demo color x check_seeds seeds, shapes alternating."""
    colors = [c for c in DEMO_COLORS for _ in range(cfg.validate_.check_seeds)]
    samples = [
        Sample(f"a {c} {DEMO_SHAPES[i % len(DEMO_SHAPES)]}", "", CHECK_SEED + i)
        for c, i in zip(colors, list(range(cfg.validate_.check_seeds)) * len(DEMO_COLORS))
    ]
    return colors, samples


def render_check(renderer: Renderer, cfg, size: tuple[int, int]) -> tuple[list[str], torch.Tensor]:
    """(prompted colors, denoiser-space latents) of the check's samples, in one batched render."""
    colors, samples = check_samples(cfg)
    v = cfg.validate_
    latents = renderer.render(samples, *size, v.check_steps, v.guidance_scale, output_type="latent")
    return colors, torch.stack([torch.as_tensor(t) for t in latents]).float().cpu()


def separation(latents: torch.Tensor, colors: list[str], means: dict[str, np.ndarray]) -> float | None:
    """Fraction of samples whose nearest class mean is their own class (samples of a class without a mean are left
    out). None when the latents are not (C, H, W) like the cache (packed-token families)."""
    keep = [i for i, c in enumerate(colors) if c in means]
    latents, colors = latents[keep], [colors[i] for i in keep]
    names = sorted(means)
    centers = np.stack([means[n] for n in names])
    if tuple(latents.shape[1:]) != centers.shape[1:]:
        return None
    dist = ((centers.reshape(len(names), -1)[None] - latents.flatten(1).numpy()[:, None]) ** 2).sum(axis=2)
    hits = sum(names[int(n)] == c for n, c in zip(dist.argmin(axis=1), colors))
    return hits / max(1, len(colors))


def trained_and_untrained(ctx, name: str, what: str, trained: Renderer, load_untrained, measure) -> dict:
    """{name, untrained_<name>}: `measure(renderer)` for the trained and the untrained model (same seeds and
    settings), or {} (logged as `what` skipped) when it gives None: rendered latents not laid out like the cache."""
    facts = {}
    for prefix, renderer in (("", trained), ("untrained_", None)):
        ctx.log.info("%s: rendering with the %s model", what, "untrained" if prefix else "trained")
        acc = measure(renderer or load_untrained())
        if acc is None:
            ctx.log.warning("%s skipped: rendered latents are not laid out like the cached ones", what)
            return {}
        facts[f"{prefix}{name}"] = acc
    ctx.log.info("%s: %s trained %.2f, untrained %.2f", what, name, facts[name], facts[f"untrained_{name}"])
    return facts


def log_image(ctx, i: int, total: int, name: str, s: Sample, started: float) -> None:
    """One line per rendered validation image, for the prompts and the edits alike (a batch's images are logged as
    the batch finishes)."""
    ctx.log.info(
        "validate: image %d/%d %s %r (seed %d), %.1f s",
        i + 1,
        total,
        name,
        s.prompt,
        s.seed,
        time.monotonic() - started,
    )
