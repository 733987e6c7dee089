"""The video demo's learning check (dataset.demo: video): does a clip rendered for "a <color> square moving <way>"
move that way?

Check clips: per direction, validate.check_seeds prompts (the colors in turn), rendered with validate.check_steps
at the square render size and the validation clips' frame count, by the trained and by the untrained model, same
seeds. A clip's motion is read from its whole latent clip (every latent frame, in the denoiser's scaled space): the
direction whose mean cached training clip (the demo's clips moving that way, stages/scan/video_demo.py) is
nearest. motion_accuracy is the share of check clips whose motion is the prompted direction; chance is 1 / 4.

Why latents and not the square's track in the decoded frames: the tiny Wan flavor's VAE is random-init, so its
decoded frames keep no motion (the reconstructions of clips moving each of the four ways give one and the same
centroid track, and so do the centroids of the latents' deviation from their temporal median), while the whole
latent clips tell the four directions apart (each of the demo's 48 clips, left out of the means in turn, is
nearest its own direction's mean).
"""

from __future__ import annotations

import torch

from tuneline.stages.caption import upstream_captions
from tuneline.stages.families import resolve as models
from tuneline.stages.render.renderer import Renderer, Sample, render_size_for
from tuneline.stages.validate.clips import clip_frames
from tuneline.stages.validate.learning import CHECK_SEED, class_means, separation, trained_and_untrained


def direction_means(ctx, upstream: dict, size: tuple[int, int], frames: int) -> dict | None:
    """Per direction, the mean cached latent of the training clips of `frames` frames at `size`; None (logged)
    when the cache holds no such bucket."""
    from tuneline.stages.scan.video_demo import DIRECTIONS

    lat, (width, height) = upstream["latents"], size
    latent_frames = (frames - 1) // models.family(ctx.cfg).facts.temporal_factor + 1
    shape = (lat.latent_channels, latent_frames * height // lat.vae_factor, width // lat.vae_factor)
    scan_dir = ctx.store.version_dir("scan", lat.upstream["scan"])
    captions = upstream_captions(ctx, upstream)
    try:
        return class_means(models.artifact_dir(ctx, lat), lat, scan_dir, shape, captions, tuple(DIRECTIONS))
    except ValueError as err:
        ctx.log.warning("motion check skipped: %s", err)
        return None


def render_motion(renderer: Renderer, cfg, size: tuple[int, int], frames: int) -> tuple[list[str], torch.Tensor]:
    """(prompted directions, folded denoiser-space latents (N, C, T*h, w)) of the check clips."""
    from tuneline.stages.scan.video_demo import check_prompts

    v, (width, height) = cfg.validate_, size
    prompts = check_prompts(v.check_seeds)
    samples = [Sample(prompt, "", CHECK_SEED + i) for i, (prompt, _) in enumerate(prompts)]
    out = renderer.render(samples, width, height, v.check_steps, v.guidance_scale, output_type="latent", frames=frames)
    latents = torch.stack([torch.as_tensor(t) for t in out]).float().cpu()
    return [d for _, d in prompts], models.family(cfg).rendered_latents(latents, width, height, renderer.pipe.vae)


def motion_accuracy(renderer: Renderer, cfg, size: tuple[int, int], frames: int, means: dict) -> float | None:
    """Share of check clips whose nearest direction mean is the prompted direction (None: shapes differ)."""
    directions, latents = render_motion(renderer, cfg, size, frames)
    return separation(latents, directions, means)


def check_motion(ctx, trained: Renderer, upstream: dict, load_untrained) -> dict:
    """motion_accuracy and untrained_motion_accuracy of the video demo (module docstring)."""
    size, frames = render_size_for(ctx.cfg, aspect=1.0), clip_frames(ctx.cfg)
    if (means := direction_means(ctx, upstream, size, frames)) is None:
        return {}

    def measure(renderer: Renderer) -> float | None:
        return motion_accuracy(renderer, ctx.cfg, size, frames, means)

    return trained_and_untrained(ctx, "motion_accuracy", "motion check", trained, load_untrained, measure)
