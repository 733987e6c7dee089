"""Validation clips of a video family: each prompt rendered as a short clip through the stock pipeline, written as
an MP4 (PyAV, H.264) for players and an animated WebP the Prefect artifact shows inline; the grid becomes a
contact sheet, one row of frames per clip."""

from __future__ import annotations

import time
from pathlib import Path

from PIL import Image

from tuneline.schemas.families import facts
from tuneline.schemas.validate import RenderedImage
from tuneline.stages.render.clipfile import write_mp4
from tuneline.stages.render.renderer import Renderer, Sample, grid
from tuneline.stages.validate.learning import log_image

SHEET_COLUMNS = 8  # frames per contact-sheet row, evenly spaced over the clip


def clip_frames(cfg) -> int:
    """Frames of each validation clip: validate.frames, else the shortest frame budget; 1 for image families."""
    from tuneline.stages.scan.video import frame_policy

    if not facts(cfg.model.family).video:
        return 1
    return cfg.validate_.frames or frame_policy(cfg).budgets[0]


def write_webp(frames: list[Image.Image], path: Path, fps: float) -> None:
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0, lossless=True)


def contact_sheet(clips: list[list[Image.Image]], columns: int = SHEET_COLUMNS) -> Image.Image:
    """One row per clip: up to `columns` of its frames, evenly spaced, first and last included."""
    rows = []
    for frames in clips:
        n = min(columns, len(frames))
        picks = [round(i * (len(frames) - 1) / max(1, n - 1)) for i in range(n)]
        rows.append(grid([frames[i] for i in picks], cols=n))
    return grid(rows, cols=1)


def render_clips(ctx, renderer: Renderer, work: Path, samples: list[Sample], size: tuple[int, int]) -> list:
    """Every prompt as a clip of clip_frames(cfg) frames at buckets.fps: `NNN-seedS.webp` + `.mp4`, and grid.png
    the contact sheet."""
    from tuneline.stages.scan.video import frame_policy

    v, (width, height) = ctx.cfg.validate_, size
    frames, fps = clip_frames(ctx.cfg), frame_policy(ctx.cfg).fps
    ctx.log.info(
        "validate: rendering %d clips of %d frames at %dx%d, %d steps", len(samples), frames, width, height, v.steps
    )
    started = time.monotonic()
    clips = renderer.render(samples, width, height, v.steps, v.guidance_scale, frames=frames)
    rendered = []
    for i, (s, clip) in enumerate(zip(samples, clips)):
        stem = f"{i:03d}-seed{s.seed}"
        write_webp(clip, work / f"{stem}.webp", fps)
        write_mp4(clip, work / f"{stem}.mp4", fps)
        log_image(ctx, i, len(samples), f"{stem}.mp4", s, started)
        rendered.append(
            RenderedImage(
                file=f"{stem}.webp",
                prompt=s.prompt,
                negative_prompt=s.negative_prompt,
                seed=s.seed,
                width=clip[0].width,
                height=clip[0].height,
                frames=len(clip),
                clip=f"{stem}.mp4",
            )
        )
    contact_sheet(clips).save(work / "grid.png")
    return rendered
